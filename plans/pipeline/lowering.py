"""Lowering: add the SEND/RECV (and same-rank HANDOFF) actions to a compute-only schedule.

Under blocking rendezvous a SEND waits until the peer reaches the matching RECV. Placing each
SEND right after its compute and each RECV right before its consumer deadlocks as soon as two
neighbours both send first (1F1B's steady state: rank r sends F to r+1 while r+1 sends B to r;
the interleaved pp=4, vpp=2, 8-microbatch hang in ../shared/ANCHORS.md).

We avoid that by construction. First we compute an expected timeline of the compute actions
(each starts when its rank is free and its input exists). Then every transfer becomes one event
at the moment its producer finishes, and all events — computes and transfers — are put in a
single global order by time. Each rank's lowered list is that global order restricted to the
events it takes part in, a transfer showing up as SEND on one side and RECV on the other. The
global order itself is a valid execution in which every rendezvous meets, so no interleaving of
the per-rank lists can deadlock, and FIFO matching per channel pairs the right transfers. Where
neighbours would both send at the same moment, the one whose producer finished first sends
first and the other receives first: the production fix, derived rather than special-cased.

The timeline only chooses among deadlock-free orders; it uses unit costs (F = I = W = 1,
B = 2) unless given the simulator's, so that blocking transfers wait as little as possible.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable

from rayshard.plans.pipeline.actions import COMPUTE_KINDS, Action, Kind, Schedule
from rayshard.plans.errors import ScheduleError

_UNIT_COSTS = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0, Kind.FB: 3.0}
# Zero-length computes would tie with the transfers they produce; a tiny length keeps the
# global order "producer, then its transfer, then the consumer".
_MIN_DURATION = 1e-9


def unit_duration(action: Action) -> float:
    return _UNIT_COSTS[action.kind]


def lower(schedule: Schedule, duration: Callable[[Action], float] | None = None) -> Schedule:
    """Return `schedule` with SEND_F/RECV_F/SEND_B/RECV_B and HANDOFF actions added.

    duration: expected time of a compute action (default unit costs); it only picks which
    deadlock-free order to emit. Raises ScheduleError when the compute order itself cannot run
    (a rank waits for an input that is only produced after it, on any rank).
    """
    if schedule.is_lowered:
        raise ScheduleError(
            f"schedule {schedule.name!r} already holds communication actions. Fix: lower the "
            "compute-only schedule from rayshard.plans.pipeline.schedules.build_schedule"
        )
    timeline = _Timeline(schedule, duration or unit_duration)
    starts, ends = timeline.starts, timeline.ends
    owner = schedule.stage_ranks
    last_stage, microbatches = schedule.num_stages - 1, schedule.microbatches
    # Events are (time, 0 for a transfer / 1 for a compute, producer rank, index, part, action);
    # the first five are unique, so sorting never compares actions.
    events: list[list[tuple]] = [[] for _ in range(schedule.pp)]
    for rank, actions in enumerate(schedule.ranks):
        rank_events = events[rank]
        rank_starts, rank_ends = starts[rank], ends[rank]
        for index, action in enumerate(actions):
            rank_events.append((rank_starts[index], 1, rank, index, 0, action))
            for part_number, part in enumerate(action.parts() if action.kind is Kind.FB else (action,)):
                kind, stage, mb = part.kind, part.stage, part.microbatch
                if kind is Kind.F and stage < last_stage:
                    target, send, recv, handoff = stage + 1, Kind.SEND_F, Kind.RECV_F, Kind.HANDOFF_F
                    needed = timeline.forward_needed[target * microbatches + mb]
                elif (kind is Kind.B or kind is Kind.I) and stage > 0:
                    target, send, recv, handoff = stage - 1, Kind.SEND_B, Kind.RECV_B, Kind.HANDOFF_B
                    needed = timeline.backward_needed[target * microbatches + mb]
                else:
                    continue
                peer = owner[target]
                produced = rank_ends[index]
                if needed is None:  # nobody consumes it; the checker will say so
                    needed = produced
                moment = _meeting_time(starts, ends, rank, peer, produced, needed)
                # Sorts after everything that started before `moment`, before what starts then.
                if peer == rank:
                    rank_events.append((moment, 0, rank, index, part_number, Action(handoff, stage, mb)))
                else:
                    rank_events.append((moment, 0, rank, index, part_number, Action(send, stage, mb, peer)))
                    events[peer].append((moment, 0, rank, index, part_number, Action(recv, target, mb, rank)))
    lowered = []
    for rank_events in events:
        rank_events.sort()
        lowered.append([event[5] for event in rank_events])
    return schedule.with_ranks(lowered)


def _meeting_time(
    starts: list[list[float]], ends: list[list[float]], sender: int, receiver: int,
    produced: float, needed: float,
) -> float:
    """The earliest moment in [produced, needed] at which neither rank is mid-compute.

    A blocking transfer placed there costs no waiting in the expected timeline. When no such
    moment exists we send as soon as the data exists: the sender waits for the receiver.
    """
    moment = produced
    while moment <= needed:
        for rank in (sender, receiver):
            index = bisect.bisect_left(starts[rank], moment) - 1
            if index >= 0 and ends[rank][index] > moment:
                moment = ends[rank][index]
                break
        else:
            return moment
    return produced


class _Timeline:
    """Start and end of every compute action when transfers are free and never block.

    Each rank runs its list in order; an action starts when the rank is free and its inputs
    exist. A rank waiting for an input parks on it and resumes when it is produced, so the work
    is linear in the number of actions. Also records when each input is first needed.
    """

    def __init__(self, schedule: Schedule, duration: Callable[[Action], float]):
        self.schedule = schedule
        stages, microbatches = schedule.num_stages, schedule.microbatches
        size = stages * microbatches
        self.size, self.microbatches, self.last_stage = size, microbatches, stages - 1
        # produced[slot]: end of stage's F for slot = stage * microbatches + mb, and end of its
        # B or I at size + slot.
        self.produced: list[float | None] = [None] * (2 * size)
        self.forward_needed: list[float | None] = [None] * size
        self.backward_needed: list[float | None] = [None] * size
        self.starts = [[0.0] * len(actions) for actions in schedule.ranks]
        self.ends = [[0.0] * len(actions) for actions in schedule.ranks]
        self._run(duration)

    def _inputs(self, part: Action) -> tuple[int, ...]:
        """Slots of `produced` that `part` needs."""
        stage, mb = part.stage, part.microbatch
        if not (0 <= stage <= self.last_stage and 0 <= mb < self.microbatches):
            raise ScheduleError(
                f"{part} is outside the schedule's {self.last_stage + 1} stages and "
                f"{self.microbatches} microbatches. Fix: generate actions within those ranges"
            )
        slot = stage * self.microbatches + mb
        kind = part.kind
        if kind is Kind.F:
            return (slot - self.microbatches,) if stage > 0 else ()
        if kind is Kind.W:
            return (self.size + slot,)
        if stage < self.last_stage:  # B or I: this stage's F and the next stage's gradient
            return (slot, self.size + slot + self.microbatches)
        return (slot,)

    def _run(self, duration: Callable[[Action], float]) -> None:
        schedule, produced, size = self.schedule, self.produced, self.size
        parked: dict[int, int] = {}  # slot -> the rank waiting for it
        clock = [0.0] * schedule.pp
        position = [0] * schedule.pp
        runnable = list(range(schedule.pp - 1, -1, -1))
        while runnable:
            rank = runnable.pop()
            actions, starts, ends = schedule.ranks[rank], self.starts[rank], self.ends[rank]
            index, start_of_rank = position[rank], clock[rank]
            while index < len(actions):
                action = actions[index]
                if action.kind not in COMPUTE_KINDS:
                    raise ScheduleError(f"lowering expects compute actions only, found {action}")
                parts = action.parts() if action.kind is Kind.FB else (action,)
                start, missing = start_of_rank, None
                for part in parts:
                    for slot in self._inputs(part):
                        ready = produced[slot]
                        if ready is None:
                            missing = slot
                            break
                        if ready > start:
                            start = ready
                    if missing is not None:
                        break
                if missing is not None:
                    parked[missing] = rank
                    break
                end = start + max(duration(action), _MIN_DURATION)
                starts[index], ends[index], start_of_rank = start, end, end
                for part in parts:
                    kind = part.kind
                    if kind is Kind.W:
                        continue
                    slot = part.stage * self.microbatches + part.microbatch
                    if kind is Kind.F:
                        self.forward_needed[slot] = start
                    else:
                        self.backward_needed[slot] = start
                        slot += size
                    if produced[slot] is not None:
                        raise ScheduleError(f"{part} appears twice. Fix: run each (stage, microbatch) once per kind")
                    produced[slot] = end
                    woken = parked.pop(slot, None)
                    if woken is not None:
                        runnable.append(woken)
                index += 1
            position[rank], clock[rank] = index, start_of_rank
        stuck = [rank for rank in range(schedule.pp) if position[rank] < len(schedule.ranks[rank])]
        if stuck:
            lines = [
                f"rank {rank} at step {position[rank]}: {schedule.ranks[rank][position[rank]]}"
                for rank in stuck
            ]
            raise ScheduleError(
                f"schedule {schedule.name!r} cannot run even with free communication: every "
                "rank left waits for an input no rank will produce first:\n  " + "\n  ".join(lines)
                + "\nFix: reorder the compute lists so each input is produced before it is needed"
            )
