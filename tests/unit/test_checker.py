"""The checker: blocking-rendezvous deadlocks and dependency violations."""
from __future__ import annotations

import pytest

from plans.pipeline.actions import Action, Kind, Schedule
from plans.pipeline.checker import check, execute
from plans.errors import ScheduleError
from plans.pipeline.lowering import lower
from plans.pipeline.schedules import build_schedule

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741
SEND_F, RECV_F, SEND_B, RECV_B = Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B


def naive_lowering(schedule: Schedule) -> Schedule:
    """What the production interleaved schedule did before its fix: every compute receives its
    input right before it and sends its output right after it, so neighbours both send first."""
    owner, last = schedule.stage_ranks, schedule.num_stages - 1
    ranks = []
    for rank, actions in enumerate(schedule.ranks):
        lowered = []
        for action in actions:
            stage, mb = action.stage, action.microbatch
            if action.kind is F:
                if stage > 0:
                    lowered.append(Action(RECV_F, stage, mb, owner[stage - 1]))
                lowered.append(action)
                if stage < last:
                    lowered.append(Action(SEND_F, stage, mb, owner[stage + 1]))
            else:
                if stage < last:
                    lowered.append(Action(RECV_B, stage, mb, owner[stage + 1]))
                lowered.append(action)
                if stage > 0:
                    lowered.append(Action(SEND_B, stage, mb, owner[stage - 1]))
        ranks.append(lowered)
    return schedule.with_ranks(ranks)


def two_rank_schedule(rank0: list[Action], rank1: list[Action], microbatches: int = 1) -> Schedule:
    return Schedule("hand-written", 2, 1, microbatches, (0, 1), [rank0, rank1])


GOOD_RANK0 = [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(RECV_B, 0, 0, 1), Action(B, 0, 0)]
GOOD_RANK1 = [Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(B, 1, 0), Action(SEND_B, 1, 0, 0)]


def test_production_deadlock_is_reported_and_the_fixed_lowering_passes():
    # ANCHORS.md: interleaved 1F1B, pp=4, 8 microbatches, vpp=2 hung because two neighbouring
    # ranks both sent before receiving.
    schedule = build_schedule("interleaved1f1b", pp=4, microbatches=8, vpp=2)

    naive = check(naive_lowering(schedule))
    assert naive.deadlock is not None and not naive.ok
    cycle = naive.deadlock.cycle
    assert len(cycle) >= 2
    # A ring: each waits for the next, and every waiting rank is stuck on a SEND.
    for waiting, after in zip(cycle, cycle[1:] + cycle[:1]):
        assert waiting.waits_for == after.rank
        assert waiting.action.kind in (SEND_F, SEND_B)
        assert naive_lowering(schedule).ranks[waiting.rank][waiting.step] == waiting.action
    text = naive.describe()
    assert "cycle" in text and f"rank {cycle[0].rank} at step {cycle[0].step}" in text
    with pytest.raises(ScheduleError, match="deadlock"):
        naive.raise_if_failed()

    fixed = check(lower(schedule))
    assert fixed.ok, fixed.describe()


def test_naive_lowering_of_plain_1f1b_deadlocks_between_two_neighbours_sending():
    deadlock = check(naive_lowering(build_schedule("1f1b", 4, 8))).deadlock
    assert deadlock is not None
    (first, second) = deadlock.cycle
    assert abs(first.rank - second.rank) == 1
    assert {first.action.kind, second.action.kind} == {SEND_F, SEND_B}


def test_hand_written_pipeline_passes():
    report = check(two_rank_schedule(GOOD_RANK0, GOOD_RANK1))
    assert report.ok, report.describe()
    assert report.violations == [] and report.deadlock is None


def test_two_ranks_sending_first_is_a_two_rank_cycle():
    rank0 = [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(RECV_B, 0, 0, 1), Action(B, 0, 0)]
    rank1 = [Action(SEND_B, 1, 0, 0), Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(B, 1, 0)]
    deadlock = check(two_rank_schedule(rank0, rank1)).deadlock
    assert deadlock is not None and deadlock.finished_peer is None
    assert {(w.rank, w.step, w.action.kind) for w in deadlock.cycle} == {(0, 1, SEND_F), (1, 0, SEND_B)}


def test_waiting_for_a_finished_rank_is_reported_as_a_chain():
    rank1 = [Action(RECV_F, 1, 0, 0)] + GOOD_RANK1  # a second receive nobody sends
    deadlock = check(two_rank_schedule(GOOD_RANK0, rank1)).deadlock
    assert deadlock is not None
    # rank 1 blocks on its first RECV; rank 0's SEND_F then pairs with it (FIFO) and rank 0
    # blocks on RECV_B, so both wait. Either way the report names steps and actions.
    assert all(waiting.action is not None for waiting in deadlock.blocked)


def test_receive_after_the_compute_that_needs_it_is_a_violation():
    rank1 = [Action(F, 1, 0), Action(RECV_F, 1, 0, 0), Action(B, 1, 0), Action(SEND_B, 1, 0, 0)]
    report = check(two_rank_schedule(GOOD_RANK0, rank1))
    assert report.deadlock is None
    assert any("before its input arrived" in v.problem and v.rank == 1 and v.step == 0 for v in report.violations)


def test_fifo_mismatch_is_a_violation():
    rank0 = [
        Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(F, 0, 1), Action(SEND_F, 0, 1, 1),
        Action(RECV_B, 0, 0, 1), Action(B, 0, 0), Action(RECV_B, 0, 1, 1), Action(B, 0, 1),
    ]
    rank1 = [  # receives microbatch 1 first while rank 0 sends microbatch 0 first
        Action(RECV_F, 1, 1, 0), Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(B, 1, 0),
        Action(SEND_B, 1, 0, 0), Action(F, 1, 1), Action(B, 1, 1), Action(SEND_B, 1, 1, 0),
    ]
    report = check(two_rank_schedule(rank0, rank1, microbatches=2))
    assert any("FIFO" in v.problem for v in report.violations)


@pytest.mark.parametrize(
    "rank0, expected",
    [
        (GOOD_RANK0 + [Action(W, 0, 0)], "W of stage 0 mb 0, but a full B already computed it"),
        (GOOD_RANK0[:3] + [Action(I, 0, 0)], "runs I but never its W"),
        (GOOD_RANK0[:3], "never runs B"),
        (GOOD_RANK0 + [Action(F, 0, 0)], "second F"),
        ([Action(F, 1, 0)] + GOOD_RANK0, "stage 1 belongs to rank 1"),
        ([Action(B, 0, 0)] + GOOD_RANK0[:3], "B before the F"),
    ],
)
def test_dependency_violations_are_named(rank0, expected):
    report = check(two_rank_schedule(rank0, GOOD_RANK1))
    assert not report.ok
    assert any(expected in str(violation) for violation in report.violations), report.describe()


def test_gradient_must_arrive_before_backward():
    rank0 = [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(B, 0, 0), Action(RECV_B, 0, 0, 1)]
    report = check(two_rank_schedule(rank0, GOOD_RANK1))
    assert any("before the gradient arrived from stage 1" in str(v) for v in report.violations)


def test_send_to_the_wrong_rank_is_a_violation():
    schedule = Schedule(
        "hand-written", 3, 1, 1, (0, 1, 2),
        [
            [Action(F, 0, 0), Action(SEND_F, 0, 0, 2)],
            [],
            [Action(RECV_F, 2, 0, 0), Action(F, 2, 0)],
        ],
    )
    report = check(schedule)
    assert any("stage 1 lives on rank 1" in str(v) for v in report.violations)


def test_execute_records_a_replayable_trace():
    report = execute(lower(build_schedule("zbv", 3, 6)))
    steps = sum(len(actions) for actions in report.schedule.ranks)
    transfers = sum(a.kind in (SEND_F, SEND_B) for actions in report.schedule.ranks for a in actions)
    assert len(report.trace) == steps - transfers  # one entry per transfer, for both sides


def test_checker_handles_a_large_pipeline():
    # Per-rank pointers and parked ranks keep this linear; bench/plans.py times pp=64.
    lowered = lower(build_schedule("interleaved1f1b", 16, 64, 2))
    assert check(lowered).ok


def test_checking_a_compute_only_schedule_says_to_lower_it():
    with pytest.raises(ScheduleError, match="lower"):
        check(build_schedule("1f1b", 2, 2))


def test_lowering_receives_before_sending_where_neighbours_would_both_send():
    # 1F1B steady state: rank 2 sends F(i+1) to rank 3 while rank 3 sends B(i) back. Rank 3
    # receives first — the production fix — and rank 2 sends first.
    last = lower(build_schedule("1f1b", 4, 8)).ranks[3]
    for mb in range(1, 7):
        assert last.index(Action(RECV_F, 3, mb + 1, 2)) < last.index(Action(SEND_B, 3, mb, 2))
