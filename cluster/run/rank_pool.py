"""The rank actors an elastic run keeps across its attempts, so a recovery restarts only the
ranks it lost (issue 41: process start dominated a recovery from memory).

The pool owns one PACKed placement group with a bundle per rank; rank i always lives in bundle
i, so tp/pp neighbours stay where the first start packed them. After a failed attempt each actor
must answer a no-op within its bound: one that does has left its process group (actors/rank.py
leaves it on a failed step, and setup leaves any previous one) and is reused; one that does not
is dead or stuck, so it is killed and another actor takes its place, keeping its CPU share. The
bound is REUSE_PROBE_S, or BUSY_PEER_BOUND_S for a peer the failed step named silent (it may be
still computing its step, or stuck in a collective): one with a warm spare on its node is
replaced at once instead (decision 185); one still silent after REUSE_PROBE_S has a spare started
on its node then, so that a stuck peer's replacement is ready as its bound ends (decision 216). A
replacement is a warm spare where the pool keeps one on the rank's node (one idle actor per node,
torch imported, no CPU or GPU reserved, started once an attempt has regained the furthest step
trained; a GPU rank's spare takes the dead rank's GPUs, decision 225), else a new actor in the
rank's bundle. Ray moves the
bundles of a lost node elsewhere where it can; where it cannot within the start timeout, or the next layout asks for another world or another share per rank, the pool is
released whole and started afresh (a smaller layout frees the extras).
"""
from __future__ import annotations

import time

import ray
from ray.util.placement_group import placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from rayshard.actors.rank import RankActor
from rayshard.cluster.run.rank_group import wait_alive, start_actors

# A free actor answers a no-op in milliseconds; a loaded 2-core machine can take a second. An
# actor stuck in a collective never answers (its calls run one at a time), so the bound only
# decides how soon it is replaced.
REUSE_PROBE_S = 2.0
# A peer the failed step named silent (no answer DEAD_RANK_GRACE_S after the death) is either
# still computing its step, and fails at its next collective within about a step, or stuck in a
# collective that the death or a departed peer never reached (measured: one such rank was still
# silent after 30 s, decision 185). Where a warm spare waits on its node it is replaced at once
# (that costs nothing); else it gets this bound to answer, overlapping the dead rank's
# replacement, before it is killed, replaced and named.
BUSY_PEER_BOUND_S = 5.0
# How long a stuck rank's own thread is given to say where its call blocked, before it is killed.
WHERE_BOUND_S = 0.5


class RankPool:
    def __init__(self, start_timeout_s: float, log=print, busy_peer_bound_s: float = BUSY_PEER_BOUND_S,
                 warm_spares: bool = True):
        self.start_timeout_s, self.log, self.busy_peer_bound_s = start_timeout_s, log, busy_peer_bound_s
        self.warm_spares = warm_spares  # one idle actor per node with ranks, to replace a dead rank at once
        self.placement, self.actors, self.bundle = None, [], None
        self.spares: dict[str, object] = {}  # node id -> an idle RankActor on it (no CPU or GPU reserved)
        # GPU ranks: rank -> the CUDA_VISIBLE_DEVICES its actor uses, asked as each actor starts, so a
        # spare can take the GPUs of a rank whose process is gone (decision 225).
        self.devices: dict[int, str] = {}
        self.adoptions: dict[int, object] = {}  # rank -> its spare's adopt_devices call, during a repair
        self.last_recovery = ""  # one line: which ranks were reused, which restarted
        self.condemned: set[int] = set()  # ranks the failed attempt found dead: replaced unprobed
        self.busy: set[int] = set()  # ranks the failed attempt named silent: probed with busy_peer_bound_s

    def condemn(self, ranks) -> None:
        """Ranks to replace without asking: their processes are gone."""
        self.condemned.update(ranks)

    def expect_busy(self, ranks) -> None:
        """Ranks that did not answer the failed call in its grace: replaced at once by a warm spare
        on their node, else given busy_peer_bound_s (not REUSE_PROBE_S) to answer (one still
        computing the failed step fails at its next collective) before they are replaced."""
        self.busy.update(ranks)

    def actors_for(self, world: int, bundle: dict[str, float]) -> list:
        """world live actors with `bundle` each: the pool's, repaired, when it has that shape."""
        if self.actors and (len(self.actors) != world or self.bundle != bundle):
            self.release()
        if not self.actors:
            self.placement, self.actors = start_actors(world, self.start_timeout_s, bundle.get("CPU", 0),
                                                       bundle.get("GPU", 0), log=self.log)
            self.bundle = dict(bundle)
            self._note_devices(range(world))
            return list(self.actors)
        try:
            self._repair()
        except BaseException:
            self.release()  # a node gone for good: start afresh on what the cluster has
            raise
        return list(self.actors)

    def _repair(self) -> None:
        started = time.monotonic()
        condemned, busy, self.condemned, self.busy = self.condemned, self.busy, set(), set()
        replaced: dict[int, str] = {}  # rank -> how its new actor came: "spare" or "new"
        for rank in sorted(condemned):  # dead: their replacements start now, beside the probes below
            replaced[rank] = self._replace(rank)
        for rank in sorted(busy - condemned):  # silent, with a warm spare on its node: replaced at once
            if self._spare_for(rank) is not None:
                replaced[rank] = self._replace(rank)
        condemned = condemned | set(replaced)
        notes: list[str] = []
        probes = {actor.__ray_ready__.remote(): rank for rank, actor in enumerate(self.actors) if rank not in condemned}
        answered = self._probe(probes, busy, started, notes)
        stuck = sorted(rank for rank in probes.values() if rank not in answered)
        where = self._where_they_wait(stuck)
        for rank in stuck:
            replaced[rank] = self._replace(rank)
        if replaced:
            self._settle_adoptions(replaced)  # first: a spare that cannot answer it would not answer wait_alive
            wait_alive(self.actors, self.start_timeout_s)
            self._note_devices([rank for rank, how in replaced.items() if how == "new"])
        reused = [rank for rank in range(len(self.actors)) if rank not in replaced]
        lost = sorted(replaced)
        if busy & set(reused):
            notes.insert(0, f"rank(s) {_ranks(sorted(busy & set(reused)))} waited for, busy finishing the failed step")
        silent = sorted(set(stuck) & busy)
        if silent:
            notes.append(f"rank(s) {_ranks(silent)} did not answer within {self.busy_peer_bound_s:g} s (treated as lost)")
        notes += where
        from_spares = [rank for rank in lost if replaced[rank] == "spare"]
        if from_spares:
            notes.append(f"rank(s) {_ranks(from_spares)} from a warm spare")
        self.last_recovery = (f"ranks reused {_ranks(reused)}, restarted {_ranks(lost)} "
                              f"({time.monotonic() - started:.1f} s" + "".join(f"; {note}" for note in notes) + ")")
        self.log(f"recovery: {self.last_recovery}")

    def _probe(self, probes: dict, busy: set[int], started: float, notes: list[str]) -> set[int]:
        """The probed ranks that answered: each within REUSE_PROBE_S, a busy one within
        busy_peer_bound_s. A peer still computing the failed step answers within about a step; a
        busy one still silent after REUSE_PROBE_S may be stuck, so a spare starts on its node then,
        beside the wait: a stuck peer costs its bound and not its bound plus a process start
        (decision 216), and one that answers leaves the spare as its node's."""
        first_bound = min(REUSE_PROBE_S, self.busy_peer_bound_s)
        answered = self._answers(probes, {rank: first_bound if rank in busy else REUSE_PROBE_S
                                          for rank in probes.values()}, started)
        slow = {ref: rank for ref, rank in probes.items() if rank in busy and rank not in answered}
        if not slow or self.busy_peer_bound_s <= first_bound:
            return answered
        if self._start_spares_on({self._bundle_nodes().get(rank) for rank in slow.values()}):
            notes.append(f"a spare started for rank(s) {_ranks(sorted(slow.values()))}, silent after {first_bound:g} s")
        return answered | self._answers(slow, {rank: self.busy_peer_bound_s for rank in slow.values()}, started)

    def _where_they_wait(self, ranks: list[int]) -> list[str]:
        """Where each stuck rank's call was blocked, asked of its own thread before it is killed (a
        hang in a collective is then found from the recovery's line); one that does not say within
        WHERE_BOUND_S is only named."""
        if not ranks:
            return []
        asked = {self.actors[rank].where_it_waits.remote(): rank for rank in ranks}
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=WHERE_BOUND_S)
        said = []
        for ref in ready:
            try:
                said.append(f"rank {asked[ref]} was {ray.get(ref)}")
            except Exception:  # noqa: BLE001 - it died meanwhile: nothing to say about it
                pass
        return sorted(said)

    def _answers(self, probes: dict, bounds: dict[int, float], started: float) -> set[int]:
        """The ranks whose probe answered within their own bound (counted from `started`)."""
        answered, pending = set(), dict(probes)
        while pending:
            deadline = started + max(bounds[rank] for rank in pending.values())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            rank = pending.pop(ready[0])
            try:
                ray.get(ready[0])
                answered.add(rank)
            except Exception:  # the actor died: replaced by the caller
                pass
            # Ranks past their own bound are given up on now, not when the longest bound ends.
            now = time.monotonic()
            pending = {ref: r for ref, r in pending.items() if started + bounds[r] > now}
        return answered

    def _replace(self, rank: int) -> str:
        """Kill rank's actor and give its place to a warm spare on its bundle's node, else to a new
        actor in its bundle. Returns which it was."""
        ray.kill(self.actors[rank], no_restart=True)
        node = self._spare_for(rank)
        spare = self.spares.pop(node) if node is not None else None
        if spare is not None:
            if self.bundle.get("GPU", 0):  # told first, not waited for: its calls run in order (_settle_adoptions)
                self.adoptions[rank] = spare.adopt_devices.remote(self.devices[rank])
            self.actors[rank] = spare
            return "spare"
        self.actors[rank] = self._new_actor(rank)
        return "new"

    def _new_actor(self, rank: int):
        return RankActor.options(
            num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank),
        ).remote()

    def _spare_for(self, rank: int) -> str | None:
        """The node of rank's bundle, where a warm spare waits on it and the node is alive (and,
        for a GPU rank, its GPUs are known: a spare gets them from the rank it replaces)."""
        node = self._bundle_nodes().get(rank)
        usable = not self.bundle.get("GPU", 0) or rank in self.devices
        return node if usable and node in self.spares and node in _alive_nodes() else None

    def _settle_adoptions(self, replaced: dict[int, str]) -> None:
        """GPU ranks: each spare that took a rank's place was told the dead rank's GPUs (the dead
        process released them; its bundle keeps them reserved, and nothing else is placed in that
        bundle). A spare that did not take them within REUSE_PROBE_S is killed and the rank gets a
        new actor in its bundle (`replaced` says so)."""
        adoptions, self.adoptions = self.adoptions, {}
        if not adoptions:
            return
        ready, _ = ray.wait(list(adoptions.values()), num_returns=len(adoptions), timeout=REUSE_PROBE_S)
        for rank, ref in adoptions.items():
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer within {REUSE_PROBE_S:g} s")
                ray.get(ref)
            except Exception as error:  # noqa: BLE001 - the spare is not usable; a new actor is
                self.log(f"warm spare not used for rank {rank} ({type(error).__name__}: "
                         f"{(str(error).splitlines() or [''])[0][:200]}); starting a new actor")
                ray.kill(self.actors[rank], no_restart=True)
                self.actors[rank], replaced[rank] = self._new_actor(rank), "new"

    def _note_devices(self, ranks) -> None:
        """GPU ranks: ask each of `ranks`' new actors which GPUs Ray gave it. Bounded; an actor
        that does not say leaves its rank without a spare (a new actor replaces it, as before)."""
        if not self.bundle.get("GPU", 0):
            return
        asked = {self.actors[rank].visible_devices.remote(): rank for rank in ranks}
        ready, _ = ray.wait(list(asked), num_returns=len(asked), timeout=REUSE_PROBE_S)
        for ref in ready:
            try:
                visible = ray.get(ref)
            except Exception:  # noqa: BLE001 - died meanwhile: its failure is the next attempt's to find
                continue
            if visible:
                self.devices[asked[ref]] = visible

    def _bundle_nodes(self) -> dict[int, str]:
        """Bundle index -> the node Ray placed it on now (a lost node's bundles may be missing)."""
        try:
            return dict(placement_group_table(self.placement).get("bundles_to_node_id", {}))
        except Exception:  # noqa: BLE001 - no placement known: no spare is used, a new actor is started
            return {}

    def start_spares(self) -> None:
        """An idle actor on every node that holds ranks and has none. It reserves no CPU and no
        GPU: it only waits, torch imported (CUDA not initialised), and once it takes a dead rank's
        place, that rank's bundle keeps the CPU and GPU reserved for it (a GPU rank's spare is told
        which GPUs first, `_settle_adoptions`).
        Not waited for, and called once an attempt has regained the furthest step trained, not as
        it starts: a spare's start (importing torch, a few CPU-seconds) ran beside the recovery's
        set-up, load and first steps on the same cores, and slowed them (decisions 213, 215)."""
        self._start_spares_on(set(self._bundle_nodes().values()))

    def _start_spares_on(self, nodes: set) -> int:
        """A warm spare on each of `nodes` that is alive and has none (see start_spares); how many
        it started."""
        started = 0
        if not self.warm_spares or not self.bundle:
            return started
        try:
            alive = _alive_nodes()
            self.spares = {node: spare for node, spare in self.spares.items() if node in alive}  # a lost node's went with it
            for node in sorted(set(nodes) & alive):
                if node not in self.spares:
                    self.spares[node] = RankActor.options(
                        num_cpus=0, num_gpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                    started += 1
        except Exception as error:  # noqa: BLE001 - a spare only speeds up the next recovery; training goes on
            self.log(f"warm spares not started ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}); "
                     "a recovery then starts new actors")
        return started

    def release(self) -> None:
        for actor in [*self.actors, *self.spares.values()]:
            ray.kill(actor, no_restart=True)
        self.spares, self.devices, self.adoptions = {}, {}, {}
        if self.placement is not None:
            remove_placement_group(self.placement)
        self.placement, self.actors, self.bundle = None, [], None


def _alive_nodes() -> set[str]:
    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}


def _ranks(ranks: list[int]) -> str:
    return "[" + ",".join(map(str, ranks)) + "]" if ranks else "none"
