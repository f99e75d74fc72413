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

from plans.actions import COMPUTE_KINDS, Action, Kind, Schedule
from plans.errors import ScheduleError

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
            "compute-only schedule from plans.schedules.build_schedule"
        )
    starts, ends = _expected_timeline(schedule, duration or unit_duration)
    consumer_start = _consumer_starts(schedule, starts)
    owner = schedule.stage_ranks
    last_stage = schedule.num_stages - 1
    keyed: list[list[tuple[tuple, Action]]] = [[] for _ in range(schedule.pp)]
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            keyed[rank].append(((starts[rank][index], 1, rank, index, 0), action))
            for part_number, part in enumerate(action.parts()):
                kind, stage, mb = part.kind, part.stage, part.microbatch
                if kind is Kind.F and stage < last_stage:
                    target, send, recv, handoff = stage + 1, Kind.SEND_F, Kind.RECV_F, Kind.HANDOFF_F
                elif kind in (Kind.B, Kind.I) and stage > 0:
                    target, send, recv, handoff = stage - 1, Kind.SEND_B, Kind.RECV_B, Kind.HANDOFF_B
                else:
                    continue
                peer = owner[target]
                produced = ends[rank][index]
                needed = consumer_start.get((kind is Kind.F, target, mb), produced)
                moment = _meeting_time(starts, ends, rank, peer, produced, needed)
                # Sorts after everything that started before `moment`, before what starts then.
                key = (moment, 0, rank, index, part_number)
                if peer == rank:
                    keyed[rank].append((key, Action(handoff, stage, mb)))
                else:
                    keyed[rank].append((key, Action(send, stage, mb, peer)))
                    keyed[peer].append((key, Action(recv, target, mb, rank)))
    lowered = []
    for events in keyed:
        events.sort(key=lambda event: event[0])
        lowered.append([action for _, action in events])
    return schedule.with_ranks(lowered)


def _consumer_starts(schedule: Schedule, starts: list[list[float]]) -> dict[tuple[bool, int, int], float]:
    """When each input is needed: (True, stage, mb) by its F, (False, stage, mb) by its B / I."""
    needed: dict[tuple[bool, int, int], float] = {}
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            for part in action.parts():
                if part.kind is not Kind.W:
                    needed[part.kind is Kind.F, part.stage, part.microbatch] = starts[rank][index]
    return needed


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


def _expected_timeline(
    schedule: Schedule, duration: Callable[[Action], float]
) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end of every compute action when transfers are free and never block.

    Each rank runs its list in order; an action starts when the rank is free and its inputs
    exist. Ranks waiting for an input park on it and resume when it is produced, so the work
    is linear in the number of actions.
    """
    num_stages, microbatches = schedule.num_stages, schedule.microbatches
    last_stage = num_stages - 1
    # End times of produced forward outputs and input gradients, by stage * microbatches + mb.
    forward_end: list[float | None] = [None] * (num_stages * microbatches)
    backward_end: list[float | None] = [None] * (num_stages * microbatches)
    parked: dict[tuple[int, int], int] = {}  # (table, index) -> the rank waiting for it
    clock = [0.0] * schedule.pp
    position = [0] * schedule.pp
    starts = [[0.0] * len(actions) for actions in schedule.ranks]
    ends = [[0.0] * len(actions) for actions in schedule.ranks]
    tables = (forward_end, backward_end)

    def missing_input(part: Action) -> tuple[int, int] | None:
        """The (table, index) that `part` still waits for, or None when it can start."""
        stage, mb = part.stage, part.microbatch
        if not (0 <= stage < num_stages and 0 <= mb < microbatches):
            raise ScheduleError(
                f"{part} is outside the schedule's {num_stages} stages and {microbatches} "
                "microbatches. Fix: generate actions within those ranges"
            )
        index = stage * microbatches + mb
        if part.kind is Kind.F:
            needed = [(0, index - microbatches)] if stage > 0 else []
        elif part.kind is Kind.W:
            needed = [(1, index)]
        else:  # B or I: the gradient from the next stage and this stage's own forward
            needed = [(0, index)] + ([(1, index + microbatches)] if stage < last_stage else [])
        for table, slot in needed:
            if tables[table][slot] is None:
                return table, slot
        return None

    def ready_time(part: Action) -> float:
        stage, mb = part.stage, part.microbatch
        index = stage * microbatches + mb
        if part.kind is Kind.F:
            return forward_end[index - microbatches] if stage > 0 else 0.0
        if part.kind is Kind.W:
            return backward_end[index]
        ready = forward_end[index]
        return max(ready, backward_end[index + microbatches]) if stage < last_stage else ready

    runnable = list(range(schedule.pp - 1, -1, -1))
    while runnable:
        rank = runnable.pop()
        actions = schedule.ranks[rank]
        index = position[rank]
        while index < len(actions):
            action = actions[index]
            if action.kind not in COMPUTE_KINDS:
                raise ScheduleError(f"lowering expects compute actions only, found {action}")
            parts = action.parts()
            waiting_for = next(filter(None, map(missing_input, parts)), None)
            if waiting_for is not None:
                parked[waiting_for] = rank
                break
            start = max([clock[rank]] + [ready_time(part) for part in parts])
            end = start + max(duration(action), _MIN_DURATION)
            starts[rank][index], ends[rank][index], clock[rank] = start, end, end
            for part in parts:
                slot = part.stage * microbatches + part.microbatch
                table = 0 if part.kind is Kind.F else 1 if part.kind in (Kind.B, Kind.I) else None
                if table is None:
                    continue
                if tables[table][slot] is not None:
                    raise ScheduleError(f"{part} appears twice. Fix: run each (stage, microbatch) once per kind")
                tables[table][slot] = end
                woken = parked.pop((table, slot), None)
                if woken is not None:
                    runnable.append(woken)
            index += 1
        position[rank] = index
    stuck = [rank for rank in range(schedule.pp) if position[rank] < len(schedule.ranks[rank])]
    if stuck:
        lines = [
            f"rank {rank} at step {position[rank]}: {schedule.ranks[rank][position[rank]]}"
            for rank in stuck
        ]
        raise ScheduleError(
            f"schedule {schedule.name!r} cannot run even with free communication: every rank "
            "left waits for an input no rank will produce first:\n  " + "\n  ".join(lines)
            + "\nFix: reorder the compute lists so each input is produced before it is needed"
        )
    return starts, ends
