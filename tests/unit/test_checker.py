"""The checker: blocking-rendezvous deadlocks and dependency violations."""
from __future__ import annotations

import pytest

from rayshard.plans.pipeline.actions import Action, Kind, Schedule
from rayshard.plans.pipeline.checker import check, execute
from rayshard.plans.errors import ScheduleError
from rayshard.plans.pipeline.lowering import lower
from rayshard.plans.pipeline.schedules import build_schedule

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
    # Rank 0 waits for a gradient from rank 1, which waits for one from rank 2, which has run its
    # whole list without ever sending it: no cycle, a chain ending at the finished rank.
    schedule = Schedule("hand-written", 3, 1, 1, (0, 1, 2), [
        [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(RECV_B, 0, 0, 1), Action(B, 0, 0)],
        [Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(SEND_F, 1, 0, 2), Action(RECV_B, 1, 0, 2), Action(B, 1, 0),
         Action(SEND_B, 1, 0, 0)],
        [Action(RECV_F, 2, 0, 1), Action(F, 2, 0), Action(B, 2, 0)],  # forgets SEND_B
    ])
    report = check(schedule)
    deadlock = report.deadlock
    assert deadlock is not None and deadlock.finished_peer == 2
    assert [(w.rank, w.step, w.action, w.waits_for) for w in deadlock.cycle] == [
        (0, 2, Action(RECV_B, 0, 0, 1), 1), (1, 3, Action(RECV_B, 1, 0, 2), 2)]
    assert deadlock.blocked == deadlock.cycle
    assert deadlock.describe() == (
        "rank 2 has finished its list and will never answer:\n"
        "  rank 0 at step 2 RECV_B(stage=0, mb=0, from rank 1) waits for rank 1\n"
        "  rank 1 at step 3 RECV_B(stage=1, mb=0, from rank 2) waits for rank 2")
    with pytest.raises(ScheduleError, match="rank 2 has finished its list and will never answer"):
        report.raise_if_failed()


def test_ranks_blocked_behind_a_cycle_are_counted_apart_from_it():
    # Ranks 0 and 1 both send first (a cycle); rank 2 waits for rank 1 behind them.
    schedule = Schedule("hand-written", 3, 1, 1, (0, 1, 2), [
        [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(RECV_B, 0, 0, 1), Action(B, 0, 0)],
        [Action(SEND_B, 1, 0, 0), Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(B, 1, 0)],
        [Action(RECV_F, 2, 0, 1), Action(F, 2, 0), Action(B, 2, 0)],
    ])
    deadlock = check(schedule).deadlock
    assert deadlock is not None and deadlock.finished_peer is None
    assert {w.rank for w in deadlock.cycle} == {0, 1} and {w.rank for w in deadlock.blocked} == {0, 1, 2}
    text = deadlock.describe()
    assert text.startswith("deadlock: these ranks wait for each other in a cycle:")
    assert text.endswith("(1 more ranks blocked behind them)")


def _same_rank_stages(rank1: list[Action]) -> Schedule:
    """Three stages on two ranks, stages 1 and 2 both on rank 1 (hand-offs between them)."""
    rank0 = [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(RECV_B, 0, 0, 1), Action(B, 0, 0)]
    return Schedule("hand-written", 2, 1, 1, (0, 1, 1), [rank0, rank1])


GOOD_HANDOFF_RANK1 = [Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(Kind.HANDOFF_F, 1, 0), Action(F, 2, 0),
                      Action(B, 2, 0), Action(Kind.HANDOFF_B, 2, 0), Action(B, 1, 0), Action(SEND_B, 1, 0, 0)]


def test_hand_offs_between_stages_of_one_rank_pass():
    report = check(_same_rank_stages(GOOD_HANDOFF_RANK1))
    assert report.ok, report.describe()


@pytest.mark.parametrize("extra, expected", [
    (Action(Kind.HANDOFF_F, 1, 0), "rank 1 step 3 HANDOFF_F(stage=1, mb=0): stage 2 mb 0 receives its data twice"),
    (Action(Kind.HANDOFF_B, 2, 0), None),
])
def test_a_hand_off_delivered_twice_is_a_violation(extra, expected):
    at = 3 if extra.kind is Kind.HANDOFF_F else 6
    rank1 = GOOD_HANDOFF_RANK1[:at] + [extra] + GOOD_HANDOFF_RANK1[at:]
    report = check(_same_rank_stages(rank1))
    assert report.deadlock is None
    expected = expected or f"rank 1 step {at} HANDOFF_B(stage=2, mb=0): stage 1 mb 0 receives its data twice"
    assert [str(v) for v in report.violations] == [expected]


def test_a_send_delivered_twice_is_a_violation():
    rank0 = [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(SEND_F, 0, 0, 1), Action(RECV_B, 0, 0, 1), Action(B, 0, 0)]
    rank1 = [Action(RECV_F, 1, 0, 0), Action(RECV_F, 1, 0, 0)] + GOOD_RANK1[1:]
    report = check(two_rank_schedule(rank0, rank1))
    assert report.deadlock is None
    assert [str(v) for v in report.violations] == [
        "rank 0 step 2 SEND_F(stage=0, mb=0, to rank 1): stage 1 mb 0 receives its data twice"]


def test_a_hand_off_across_ranks_or_before_its_compute_is_a_violation():
    early = [Action(RECV_F, 1, 0, 0), Action(Kind.HANDOFF_F, 1, 0)] + GOOD_HANDOFF_RANK1[1:2] + GOOD_HANDOFF_RANK1[3:]
    problems = [str(v) for v in check(_same_rank_stages(early)).violations]
    assert "rank 1 step 1 HANDOFF_F(stage=1, mb=0): hands off stage 1's result before this rank computed it" in problems
    # Stage 0 lives on rank 0: rank 0 handing its output to stage 1 (on rank 1) must use SEND/RECV.
    rank0 = [Action(F, 0, 0), Action(Kind.HANDOFF_F, 0, 0), Action(RECV_B, 0, 0, 1), Action(B, 0, 0)]
    rank1 = GOOD_HANDOFF_RANK1[1:]
    problems = [str(v) for v in check(Schedule("hand-written", 2, 1, 1, (0, 1, 1), [rank0, rank1])).violations]
    assert "rank 0 step 1 HANDOFF_F(stage=0, mb=0): stage 1 is on rank 1, not here: use SEND/RECV" in problems


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
    assert str(report.violations[0]) == \
        "rank 0 step 1 SEND_F(stage=0, mb=0, to rank 2): stage 1 lives on rank 1, but this sends it to rank 2"


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
    with pytest.raises(ScheduleError) as error:
        check(build_schedule("1f1b", 2, 2))
    assert str(error.value) == ("schedule '1f1b' has no SEND/RECV actions, so no stage would ever get its input. "
                                "Fix: check rayshard.plans.pipeline.lowering.lower(schedule)")


def test_lowering_receives_before_sending_where_neighbours_would_both_send():
    # 1F1B steady state: rank 2 sends F(i+1) to rank 3 while rank 3 sends B(i) back. Rank 3
    # receives first — the production fix — and rank 2 sends first.
    last = lower(build_schedule("1f1b", 4, 8)).ranks[3]
    for mb in range(1, 7):
        assert last.index(Action(RECV_F, 3, mb + 1, 2)) < last.index(Action(SEND_B, 3, mb, 2))


# --- every rule, with the exact violation it reports (rank, step, action and words) ---------------

def _second_f(count: int) -> Schedule:
    return two_rank_schedule([Action(F, 0, 0)] * (count + 1) + GOOD_RANK0[1:], GOOD_RANK1)


NAIVE_FIFO_RANK0 = [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(F, 0, 1), Action(SEND_F, 0, 1, 1),
                    Action(RECV_B, 0, 1, 1), Action(B, 0, 1), Action(RECV_B, 0, 0, 1), Action(B, 0, 0)]
NAIVE_FIFO_RANK1 = [Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(RECV_F, 1, 1, 0), Action(F, 1, 1),
                    Action(B, 1, 0), Action(SEND_B, 1, 0, 0), Action(B, 1, 1), Action(SEND_B, 1, 1, 0)]

EXACT_VIOLATIONS = {
    "W without its I": (
        two_rank_schedule(GOOD_RANK0[:3] + [Action(W, 0, 0)], GOOD_RANK1),
        ["rank 0 step 3 W(stage=0, mb=0): W of stage 0 mb 0, but its I has not run", "stage 0 mb 0 never runs B (or I)"]),
    "second W": (
        two_rank_schedule(GOOD_RANK0[:3] + [Action(I, 0, 0), Action(W, 0, 0), Action(W, 0, 0)], GOOD_RANK1),
        ["rank 0 step 5 W(stage=0, mb=0): second W of stage 0 mb 0"]),
    "second backward": (
        two_rank_schedule(GOOD_RANK0 + [Action(B, 0, 0)], GOOD_RANK1),
        ["rank 0 step 4 B(stage=0, mb=0): second backward of stage 0 mb 0"]),
    "I before its F": (
        two_rank_schedule([Action(I, 0, 0)] + GOOD_RANK0[:3] + [Action(W, 0, 0)], GOOD_RANK1),
        ["rank 0 step 0 I(stage=0, mb=0): I before the F of stage 0 mb 0",
         "rank 0 step 0 I(stage=0, mb=0): I before the gradient arrived from stage 1 (rank 1); it needs an earlier "
         "RECV_B or HANDOFF_B"]),
    "a stage run on another rank": (
        two_rank_schedule([Action(F, 1, 0)] + GOOD_RANK0, GOOD_RANK1),
        ["rank 0 step 0 F(stage=1, mb=0): stage 1 belongs to rank 1",
         "rank 0 step 0 F(stage=1, mb=0): F before its input arrived from stage 0 (rank 0); it needs an earlier RECV_F "
         "or HANDOFF_F",
         "rank 1 step 1 F(stage=1, mb=0): second F of stage 1 mb 0"]),
    "a microbatch out of range": (
        two_rank_schedule(GOOD_RANK0 + [Action(F, 0, 1)], GOOD_RANK1),
        ["rank 0 step 4 F(stage=0, mb=1): stage 0 / microbatch 1 is outside the pipeline's 2 stages and 1 microbatches"]),
    "a stage out of range": (
        two_rank_schedule(GOOD_RANK0 + [Action(F, 2, 0)], GOOD_RANK1),
        ["rank 0 step 4 F(stage=2, mb=0): stage 2 / microbatch 0 is outside the pipeline's 2 stages and 1 microbatches"]),
    "the last stage sending on": (
        two_rank_schedule(GOOD_RANK0 + [Action(RECV_F, 0, 0, 1)], GOOD_RANK1 + [Action(SEND_F, 1, 0, 0)]),
        ["rank 1 step 4 SEND_F(stage=1, mb=0, to rank 0): stage 2 / microbatch 0 is outside the pipeline's 2 stages "
         "and 1 microbatches"]),
    "peers that are not another rank": (  # reported, skipped, and the rest of the list runs on
        two_rank_schedule([Action(F, 0, 0), Action(SEND_F, 0, 0, 0), Action(SEND_F, 0, 0, 7)] + GOOD_RANK0[1:], GOOD_RANK1),
        ["rank 0 step 1 SEND_F(stage=0, mb=0, to rank 0): peer rank 0 is not another rank of this pipeline",
         "rank 0 step 2 SEND_F(stage=0, mb=0, to rank 7): peer rank 7 is not another rank of this pipeline"]),
    "a peer one past the last rank": (
        two_rank_schedule([Action(F, 0, 0), Action(SEND_F, 0, 0, 2)] + GOOD_RANK0[1:], GOOD_RANK1),
        ["rank 0 step 1 SEND_F(stage=0, mb=0, to rank 2): peer rank 2 is not another rank of this pipeline"]),
    "a send of a stage out of range": (
        two_rank_schedule(GOOD_RANK0 + [Action(SEND_F, 5, 0, 1)], GOOD_RANK1 + [Action(RECV_F, 6, 0, 0)]),
        ["rank 0 step 4 SEND_F(stage=5, mb=0, to rank 1): stage 5 / microbatch 0 is outside the pipeline's 2 stages "
         "and 1 microbatches"]),  # reported once, at the sender: the transfer is not checked further
    "a backward before the gradient from the next rank (three ranks)": (
        Schedule("hand-written", 3, 1, 1, (0, 1, 2), [
            [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(RECV_B, 0, 0, 1), Action(B, 0, 0)],
            [Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(SEND_F, 1, 0, 2), Action(B, 1, 0), Action(RECV_B, 1, 0, 2),
             Action(SEND_B, 1, 0, 0)],
            [Action(RECV_F, 2, 0, 1), Action(F, 2, 0), Action(B, 2, 0), Action(SEND_B, 2, 0, 1)]]),
        ["rank 1 step 3 B(stage=1, mb=0): B before the gradient arrived from stage 2 (rank 2); it needs an earlier "
         "RECV_B or HANDOFF_B"]),
    "an FB whose forward half is out of range": (  # the backward half is still checked
        Schedule("hand-written", 1, 1, 1, (0,), [[Action(Kind.FB, 0, 1, backward_stage=0, backward_microbatch=0)]]),
        ["rank 0 step 0 FB(stage=0, mb=1 | B stage=0, mb=0): stage 0 / microbatch 1 is outside the pipeline's 1 "
         "stages and 1 microbatches",
         "rank 0 step 0 FB(stage=0, mb=1 | B stage=0, mb=0): B before the F of stage 0 mb 0",
         "stage 0 mb 0 never runs F"]),
    "a send before the forward": (
        two_rank_schedule([Action(SEND_F, 0, 0, 1), Action(F, 0, 0)] + GOOD_RANK0[2:], GOOD_RANK1),
        ["rank 0 step 0 SEND_F(stage=0, mb=0, to rank 1): sends stage 0's result before this rank computed it"]),
    "a gradient sent before the backward": (
        two_rank_schedule(GOOD_RANK0, GOOD_RANK1[:2] + [Action(SEND_B, 1, 0, 0), Action(B, 1, 0)]),
        ["rank 1 step 2 SEND_B(stage=1, mb=0, to rank 0): sends stage 1's result before this rank computed it"]),
    "a backward FIFO mismatch": (
        two_rank_schedule(NAIVE_FIFO_RANK0, NAIVE_FIFO_RANK1, microbatches=2),
        ["rank 0 step 4 RECV_B(stage=0, mb=1, from rank 1): FIFO channel rank 1 -> rank 0 (backward) pairs it with rank 1 "
         "step 5 SEND_B(stage=1, mb=0, to rank 0), which carries stage 0 mb 0; order the RECVs like the peer's SENDs",
         "rank 0 step 5 B(stage=0, mb=1): B before the gradient arrived from stage 1 (rank 1); it needs an earlier RECV_B "
         "or HANDOFF_B",
         "rank 0 step 6 RECV_B(stage=0, mb=0, from rank 1): FIFO channel rank 1 -> rank 0 (backward) pairs it with rank 1 "
         "step 7 SEND_B(stage=1, mb=1, to rank 0), which carries stage 0 mb 1; order the RECVs like the peer's SENDs"]),
    "a forward FIFO mismatch": (
        two_rank_schedule(
            [Action(F, 0, 0), Action(SEND_F, 0, 0, 1), Action(F, 0, 1), Action(SEND_F, 0, 1, 1),
             Action(RECV_B, 0, 0, 1), Action(B, 0, 0), Action(RECV_B, 0, 1, 1), Action(B, 0, 1)],
            [Action(RECV_F, 1, 1, 0), Action(RECV_F, 1, 0, 0), Action(F, 1, 0), Action(B, 1, 0),
             Action(SEND_B, 1, 0, 0), Action(F, 1, 1), Action(B, 1, 1), Action(SEND_B, 1, 1, 0)], microbatches=2),
        ["rank 1 step 0 RECV_F(stage=1, mb=1, from rank 0): FIFO channel rank 0 -> rank 1 (forward) pairs it with rank 0 "
         "step 1 SEND_F(stage=0, mb=0, to rank 1), which carries stage 1 mb 0; order the RECVs like the peer's SENDs",
         "rank 1 step 1 RECV_F(stage=1, mb=0, from rank 0): FIFO channel rank 0 -> rank 1 (forward) pairs it with rank 0 "
         "step 3 SEND_F(stage=0, mb=1, to rank 1), which carries stage 1 mb 1; order the RECVs like the peer's SENDs"]),
    "a stage that never computes": (
        two_rank_schedule(GOOD_RANK0[:3], [Action(RECV_F, 1, 0, 0), Action(SEND_B, 1, 0, 0)]),
        ["rank 1 step 1 SEND_B(stage=1, mb=0, to rank 0): sends stage 1's result before this rank computed it",
         "stage 0 mb 0 never runs B (or I)", "stage 1 mb 0 never runs F", "stage 1 mb 0 never runs B (or I)"]),
}


@pytest.mark.parametrize("case", list(EXACT_VIOLATIONS))
def test_each_rule_reports_exactly_its_violations(case):
    schedule, expected = EXACT_VIOLATIONS[case]
    report = check(schedule)
    assert report.deadlock is None, report.describe()
    assert [str(v) for v in report.violations] == expected
    lines = report.describe().splitlines()
    assert lines[:2] == ["hand-written: INVALID", f"{len(expected)} dependency violation(s):"]
    assert lines[2:] == [f"  {line}" for line in expected]


def test_a_valid_report_says_how_many_steps_on_how_many_ranks():
    assert check(two_rank_schedule(GOOD_RANK0, GOOD_RANK1)).describe() == \
        "hand-written: ok (8 steps on 2 ranks, no deadlock, dependencies hold)"
    # One rank needs no SEND/RECV: an unlowered single-stage schedule is checked, not refused.
    single = Schedule("one", 1, 1, 2, (0,), [[Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 1), Action(B, 0, 0)]])
    assert check(single).describe() == "one: ok (4 steps on 1 ranks, no deadlock, dependencies hold)"


def test_the_report_lists_twenty_violations_then_counts_the_rest():
    exactly = check(_second_f(20)).describe().splitlines()
    assert len(exactly) == 22 and exactly[1] == "20 dependency violation(s):" and "..." not in exactly[-1]
    more = check(_second_f(22)).describe().splitlines()
    assert more[1] == "22 dependency violation(s):" and len(more) == 23
    assert more[-2] == "  rank 0 step 20 F(stage=0, mb=0): second F of stage 0 mb 0"
    assert more[-1] == "  ... and 2 more"


def test_execute_checks_nothing_and_traces_who_advanced():
    schedule, _ = EXACT_VIOLATIONS["W without its I"]
    report = execute(schedule)
    assert report.violations == [] and report.deadlock is None
    # F on 0; the SEND_F/RECV_F pair (its sender, 0); F and B on 1; SEND_B/RECV_B (sender 1); W on 0.
    assert report.trace == [0, 0, 1, 1, 1, 0]


def test_a_skipped_bad_peer_still_counts_as_its_ranks_step_in_the_trace():
    schedule, _ = EXACT_VIOLATIONS["peers that are not another rank"]
    # F, the two bad SENDs (skipped), SEND_F/RECV_F (sender 0), F and B on 1, SEND_B/RECV_B (sender 1), B on 0.
    assert check(schedule).trace == [0, 0, 0, 0, 1, 1, 1, 0]
