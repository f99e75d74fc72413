"""The rank actors an elastic run keeps across its attempts, so a recovery restarts only the
ranks it lost (issue 41: process start dominated a recovery from memory).

The pool owns one PACKed placement group with a bundle per rank; rank i always lives in bundle
i, so tp/pp neighbours stay where the first start packed them. After a failed attempt each actor
must answer a no-op within REUSE_PROBE_S: one that does has left its process group (actors/rank.py
leaves it on a failed step, and setup leaves any previous one) and is reused; one that does not
is dead or stuck in a collective with the dead rank, so it is killed and a new actor takes its
bundle, keeping its CPU share. Ray moves the bundles of a lost node elsewhere where it can; where
it cannot within the start timeout, or the next layout asks for another world or another share
per rank, the pool is released whole and started afresh (a smaller layout frees the extras).
"""
from __future__ import annotations

import time

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayshard.actors.rank import RankActor
from rayshard.cluster.run.rank_group import wait_alive, start_actors

# A free actor answers a no-op in milliseconds; a loaded 2-core machine can take a second. An
# actor stuck in a collective never answers (its calls run one at a time), so the bound only
# decides how soon it is replaced.
REUSE_PROBE_S = 2.0


class RankPool:
    def __init__(self, start_timeout_s: float, log=print):
        self.start_timeout_s, self.log = start_timeout_s, log
        self.placement, self.actors, self.bundle = None, [], None
        self.last_recovery = ""  # one line: which ranks were reused, which restarted
        self.condemned: set[int] = set()  # ranks the failed attempt found dead or silent: replaced unprobed

    def condemn(self, ranks) -> None:
        """Ranks to replace without asking: dead, or silent in a collective with a dead peer
        (waiting for them would cost more than restarting them alongside the dead one)."""
        self.condemned.update(ranks)

    def actors_for(self, world: int, bundle: dict[str, float]) -> list:
        """world live actors with `bundle` each: the pool's, repaired, when it has that shape."""
        if self.actors and (len(self.actors) != world or self.bundle != bundle):
            self.release()
        if not self.actors:
            self.placement, self.actors = start_actors(world, self.start_timeout_s, bundle.get("CPU", 0),
                                                       bundle.get("GPU", 0), log=self.log)
            self.bundle = dict(bundle)
            return list(self.actors)
        try:
            self._repair()
        except BaseException:
            self.release()  # a node gone for good: start afresh on what the cluster has
            raise
        return list(self.actors)

    def _repair(self) -> None:
        started = time.monotonic()
        condemned, self.condemned = self.condemned, set()
        probes = {actor.__ray_ready__.remote(): rank for rank, actor in enumerate(self.actors) if rank not in condemned}
        ready, _ = ray.wait(list(probes), num_returns=len(probes), timeout=REUSE_PROBE_S) if probes else ([], [])
        answered = set()
        for ref in ready:
            try:
                ray.get(ref)
                answered.add(probes[ref])
            except Exception:  # the actor died: replaced below
                pass
        lost = [rank for rank in range(len(self.actors)) if rank not in answered]
        for rank in lost:
            ray.kill(self.actors[rank], no_restart=True)
            self.actors[rank] = RankActor.options(
                num_cpus=self.bundle.get("CPU", 0), num_gpus=self.bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=rank),
            ).remote()
        if lost:
            wait_alive(self.actors, self.start_timeout_s)
        reused = [rank for rank in range(len(self.actors)) if rank not in lost]
        self.last_recovery = (f"ranks reused {_ranks(reused)}, restarted {_ranks(lost)} "
                              f"({time.monotonic() - started:.1f} s)")
        self.log(f"recovery: {self.last_recovery}")

    def release(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.placement is not None:
            remove_placement_group(self.placement)
        self.placement, self.actors, self.bundle = None, [], None


def _ranks(ranks: list[int]) -> str:
    return "[" + ",".join(map(str, ranks)) + "]" if ranks else "none"
