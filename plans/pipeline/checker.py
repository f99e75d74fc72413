"""Checker: run lowered per-rank action lists under blocking-rendezvous semantics.

Semantics (the strictest a runtime can have, so a plan that passes here cannot hang on gloo,
NCCL or anything that buffers more):
- each rank runs its list in order;
- a SEND blocks until the peer reaches the matching RECV, and a RECV until the peer reaches
  the matching SEND; the transfer then completes on both sides at once;
- matching is FIFO per channel (sender, receiver, direction): the k-th SEND_F from a to b
  meets the k-th RECV_F on b from a.

A deadlock is reported as the cycle of ranks waiting for each other, each with its step index
and action (or as a chain ending at a rank that has finished and will never answer).
Independently, every step is checked against the data it needs: F after its input arrived,
B / I after this stage's F and after the gradient from the next stage arrived, W after its I,
every (stage, microbatch) run exactly once per kind (one F; one B, or one I and one W), each
transfer carrying the stage and microbatch its receiver expects, each stage on its own rank.

Cost is linear in the number of actions: one pointer per rank, and a rank blocked on a
transfer is parked until its peer arrives, so no step rescans other ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rayshard.plans.pipeline.actions import MATCHING_KIND, RECV_KINDS, SEND_KINDS, Action, Kind, Schedule
from rayshard.plans.errors import ScheduleError

_MAX_LISTED_VIOLATIONS = 20


@dataclass(frozen=True)
class Waiting:
    """A rank stuck at `step` on `action`, waiting for rank `waits_for`."""

    rank: int
    step: int
    action: Action
    waits_for: int

    def __str__(self) -> str:
        return f"rank {self.rank} at step {self.step} {self.action} waits for rank {self.waits_for}"


@dataclass(frozen=True)
class Deadlock:
    """`cycle`: ranks that wait on each other in a ring (the last waits for the first), or a
    chain whose last rank waits for a rank that has finished. `blocked`: every stuck rank."""

    cycle: tuple[Waiting, ...]
    blocked: tuple[Waiting, ...]
    finished_peer: int | None = None

    def describe(self) -> str:
        if self.finished_peer is not None:
            head = f"rank {self.finished_peer} has finished its list and will never answer:"
        else:
            head = "deadlock: these ranks wait for each other in a cycle:"
        lines = [head] + [f"  {waiting}" for waiting in self.cycle]
        others = [waiting for waiting in self.blocked if waiting not in self.cycle]
        if others:
            lines.append(f"  ({len(others)} more ranks blocked behind them)")
        return "\n".join(lines)


@dataclass(frozen=True)
class Violation:
    """A step that runs without the data it needs, or a (stage, microbatch) run wrongly."""

    problem: str
    rank: int | None = None
    step: int | None = None
    action: Action | None = None

    def __str__(self) -> str:
        where = f"rank {self.rank} step {self.step} {self.action}: " if self.rank is not None else ""
        return where + self.problem


@dataclass
class CheckReport:
    """Outcome of `check`. `trace` is the order in which steps completed (see `execute`)."""

    schedule: Schedule
    deadlock: Deadlock | None
    violations: list[Violation] = field(default_factory=list)
    trace: list[int] = field(default_factory=list, repr=False)

    @property
    def ok(self) -> bool:
        return self.deadlock is None and not self.violations

    def describe(self) -> str:
        name = self.schedule.name
        if self.ok:
            steps = sum(len(actions) for actions in self.schedule.ranks)
            return f"{name}: ok ({steps} steps on {self.schedule.pp} ranks, no deadlock, dependencies hold)"
        lines = [f"{name}: INVALID"]
        if self.deadlock is not None:
            lines.append(self.deadlock.describe())
        if self.violations:
            lines.append(f"{len(self.violations)} dependency violation(s):")
            lines += [f"  {violation}" for violation in self.violations[:_MAX_LISTED_VIOLATIONS]]
            if len(self.violations) > _MAX_LISTED_VIOLATIONS:
                lines.append(f"  ... and {len(self.violations) - _MAX_LISTED_VIOLATIONS} more")
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise ScheduleError(self.describe())


def check(schedule: Schedule) -> CheckReport:
    """Run the lowered lists of `schedule`; report a deadlock and every dependency violation."""
    if schedule.pp > 1 and not schedule.is_lowered:
        raise ScheduleError(
            f"schedule {schedule.name!r} has no SEND/RECV actions, so no stage would ever get "
            "its input. Fix: check rayshard.plans.pipeline.lowering.lower(schedule)"
        )
    return _Run(schedule, verify=True).report()


def execute(schedule: Schedule) -> CheckReport:
    """Run the lists for their completion order only (no dependency checks): the simulator's
    entry point. `report.trace` lists, per completed step, the rank that advanced: for a
    transfer, the sender (whose peer advances through the matching RECV at the same moment)."""
    return _Run(schedule, verify=False).report()


class _Run:
    def __init__(self, schedule: Schedule, verify: bool):
        self.schedule = schedule
        self.verify = verify
        self.violations: list[Violation] = []
        self.trace: list[int] = []
        stages, microbatches = schedule.num_stages, schedule.microbatches
        size = stages * microbatches
        # Per (stage, microbatch) slot: what has happened to it so far.
        self.forward_done = bytearray(size)
        self.backward_done = bytearray(size)  # 1: full backward B, 2: input-grad I
        self.weight_done = bytearray(size)
        self.input_arrived = bytearray(size)  # stage's forward input is on its rank
        self.grad_arrived = bytearray(size)  # stage's output gradient is on its rank
        self.position = [0] * schedule.pp
        self.waiting: list[Action | None] = [None] * schedule.pp
        self.deadlock = self._run()

    def report(self) -> CheckReport:
        if self.verify and self.deadlock is None:
            self._check_completeness()
        return CheckReport(self.schedule, self.deadlock, self.violations, self.trace)

    # --- execution ----------------------------------------------------------------------

    def _run(self) -> Deadlock | None:
        ranks, position, waiting, trace = self.schedule.ranks, self.position, self.waiting, self.trace
        pp, verify = self.schedule.pp, self.verify
        runnable = list(range(pp - 1, -1, -1))
        while runnable:
            rank = runnable.pop()
            actions = ranks[rank]
            step, count = position[rank], len(actions)
            while step < count:
                action = actions[step]
                kind = action.kind
                if kind in SEND_KINDS or kind in RECV_KINDS:
                    peer = action.peer
                    if not (0 <= peer < pp) or peer == rank:
                        self._violate(f"peer rank {peer} is not another rank of this pipeline", rank, step, action)
                        trace.append(rank)
                        step += 1
                        continue
                    other = waiting[peer]
                    if other is None or other.kind is not MATCHING_KIND[kind] or other.peer != rank:
                        waiting[rank] = action  # park until the peer reaches the match
                        break
                    if kind in SEND_KINDS:
                        if verify:
                            self._transfer(rank, step, action, peer, position[peer], other)
                        trace.append(rank)
                    else:
                        if verify:
                            self._transfer(peer, position[peer], other, rank, step, action)
                        trace.append(peer)
                    waiting[peer] = None
                    position[peer] += 1
                    runnable.append(peer)
                elif verify:
                    self._compute(rank, step, action)
                    trace.append(rank)
                else:
                    trace.append(rank)
                step += 1
            position[rank] = step
        return self._find_deadlock()

    def _find_deadlock(self) -> Deadlock | None:
        ranks, position = self.schedule.ranks, self.position
        blocked = [
            Waiting(rank, position[rank], ranks[rank][position[rank]], ranks[rank][position[rank]].peer)
            for rank in range(self.schedule.pp)
            if position[rank] < len(ranks[rank])
        ]
        if not blocked:
            return None
        by_rank = {waiting.rank: waiting for waiting in blocked}
        chain, seen, rank = [], {}, blocked[0].rank
        while rank in by_rank and rank not in seen:
            seen[rank] = len(chain)
            chain.append(by_rank[rank])
            rank = by_rank[rank].waits_for
        if rank in seen:
            return Deadlock(tuple(chain[seen[rank]:]), tuple(blocked))
        return Deadlock(tuple(chain), tuple(blocked), finished_peer=rank)

    # --- dependency checks ---------------------------------------------------------------

    def _violate(self, problem: str, rank=None, step=None, action=None) -> None:
        self.violations.append(Violation(problem, rank, step, action))

    def _slot(self, rank: int, step: int, action: Action, stage: int, mb: int) -> int | None:
        schedule = self.schedule
        if not (0 <= stage < schedule.num_stages and 0 <= mb < schedule.microbatches):
            self._violate(
                f"stage {stage} / microbatch {mb} is outside the pipeline's "
                f"{schedule.num_stages} stages and {schedule.microbatches} microbatches",
                rank, step, action,
            )
            return None
        return stage * schedule.microbatches + mb

    def _compute(self, rank: int, step: int, action: Action) -> None:
        if action.kind is Kind.HANDOFF_F or action.kind is Kind.HANDOFF_B:
            self._handoff(rank, step, action)
            return
        owner, last_stage = self.schedule.stage_ranks, self.schedule.num_stages - 1
        for part in action.parts():
            kind, stage = part.kind, part.stage
            slot = self._slot(rank, step, action, stage, part.microbatch)
            if slot is None:
                continue
            if owner[stage] != rank:
                self._violate(f"stage {stage} belongs to rank {owner[stage]}", rank, step, action)
            if kind is Kind.F:
                if self.forward_done[slot]:
                    self._violate(f"second F of stage {stage} mb {part.microbatch}", rank, step, action)
                if stage > 0 and not self.input_arrived[slot]:
                    self._violate(
                        f"F before its input arrived from stage {stage - 1} (rank "
                        f"{owner[stage - 1]}); it needs an earlier RECV_F or HANDOFF_F",
                        rank, step, action,
                    )
                self.forward_done[slot] = 1
            elif kind is Kind.W:
                if self.backward_done[slot] != 2:
                    what = "a full B already computed it" if self.backward_done[slot] == 1 else "its I has not run"
                    self._violate(f"W of stage {stage} mb {part.microbatch}, but {what}", rank, step, action)
                if self.weight_done[slot]:
                    self._violate(f"second W of stage {stage} mb {part.microbatch}", rank, step, action)
                self.weight_done[slot] = 1
            else:  # B or I
                if not self.forward_done[slot]:
                    self._violate(f"{kind.value} before the F of stage {stage} mb {part.microbatch}", rank, step, action)
                if self.backward_done[slot]:
                    self._violate(f"second backward of stage {stage} mb {part.microbatch}", rank, step, action)
                if stage < last_stage and not self.grad_arrived[slot]:
                    self._violate(
                        f"{kind.value} before the gradient arrived from stage {stage + 1} (rank "
                        f"{owner[stage + 1]}); it needs an earlier RECV_B or HANDOFF_B",
                        rank, step, action,
                    )
                self.backward_done[slot] = 1 if kind is Kind.B else 2

    def _handoff(self, rank: int, step: int, action: Action) -> None:
        target = self._delivered(rank, step, action, "hands off")
        if target is None:
            return
        owner = self.schedule.stage_ranks
        if owner[target] != rank:
            self._violate(f"stage {target} is on rank {owner[target]}, not here: use SEND/RECV", rank, step, action)
        self._arrive(target, rank, step, action)

    def _transfer(
        self, sender: int, send_step: int, send: Action, receiver: int, recv_step: int, recv: Action
    ) -> None:
        target = self._delivered(sender, send_step, send, "sends")
        if target is None:
            return
        owner = self.schedule.stage_ranks
        if owner[target] != receiver:
            self._violate(
                f"stage {target} lives on rank {owner[target]}, but this sends it to rank {receiver}",
                sender, send_step, send,
            )
        if (recv.stage, recv.microbatch) != (target, send.microbatch):
            self._violate(
                f"FIFO channel rank {sender} -> rank {receiver} ({'forward' if _forward(send) else 'backward'}) "
                f"pairs it with rank {sender} step {send_step} {send}, which carries stage "
                f"{target} mb {send.microbatch}; order the RECVs like the peer's SENDs",
                receiver, recv_step, recv,
            )
        self._arrive(target, sender, send_step, send)

    def _delivered(self, rank: int, step: int, action: Action, verb: str) -> int | None:
        """What a hand-off and a send both require: the stage's result exists, computed on this
        rank. Returns the stage it goes to (None if either stage is out of range, reported)."""
        target = action.stage + (1 if _forward(action) else -1)
        slot = self._slot(rank, step, action, action.stage, action.microbatch)
        if slot is None or self._slot(rank, step, action, target, action.microbatch) is None:
            return None
        produced = self.forward_done[slot] if _forward(action) else self.backward_done[slot]
        if not produced or self.schedule.stage_ranks[action.stage] != rank:
            self._violate(f"{verb} stage {action.stage}'s result before this rank computed it", rank, step, action)
        return target

    def _arrive(self, target: int, rank: int, step: int, action: Action) -> None:
        """The target stage's input (forward) or output gradient (backward) arrives: exactly once."""
        arrived = self.input_arrived if _forward(action) else self.grad_arrived
        target_slot = target * self.schedule.microbatches + action.microbatch
        if arrived[target_slot]:
            self._violate(f"stage {target} mb {action.microbatch} receives its data twice", rank, step, action)
        arrived[target_slot] = 1

    def _check_completeness(self) -> None:
        microbatches = self.schedule.microbatches
        for slot in range(len(self.forward_done)):
            stage, mb = divmod(slot, microbatches)
            if not self.forward_done[slot]:
                self._violate(f"stage {stage} mb {mb} never runs F")
            if not self.backward_done[slot]:
                self._violate(f"stage {stage} mb {mb} never runs B (or I)")
            elif self.backward_done[slot] == 2 and not self.weight_done[slot]:
                self._violate(f"stage {stage} mb {mb} runs I but never its W")


def _forward(action: Action) -> bool:
    """Whether a transfer or hand-off carries an activation (forward) or a gradient (backward)."""
    return action.kind in (Kind.SEND_F, Kind.RECV_F, Kind.HANDOFF_F)
