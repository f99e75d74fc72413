"""Lowering, by its exact output on small schedules (checked by hand against the rule: a transfer
happens when its producer finishes, a rank whose neighbour would send at the same moment receives
first) and by its exact refusals."""
import pytest

from rayshard.plans.errors import ScheduleError
from rayshard.plans.pipeline.actions import Action, Kind, Schedule
from rayshard.plans.pipeline.checker import check
from rayshard.plans.pipeline.lowering import lower
from rayshard.plans.pipeline.schedules import build_schedule

F, B = Kind.F, Kind.B


def _text(schedule: Schedule) -> list[list[str]]:
    return [[str(action) for action in actions] for actions in schedule.ranks]


def test_1f1b_on_two_ranks_receives_first_where_both_would_send():
    lowered = lower(build_schedule("1f1b", 2, 3))
    assert check(lowered).ok
    assert _text(lowered) == [
        ["F(stage=0, mb=0)", "SEND_F(stage=0, mb=0, to rank 1)", "F(stage=0, mb=1)", "SEND_F(stage=0, mb=1, to rank 1)",
         "RECV_B(stage=0, mb=0, from rank 1)", "B(stage=0, mb=0)", "F(stage=0, mb=2)", "SEND_F(stage=0, mb=2, to rank 1)",
         "RECV_B(stage=0, mb=1, from rank 1)", "B(stage=0, mb=1)", "RECV_B(stage=0, mb=2, from rank 1)", "B(stage=0, mb=2)"],
        # rank 1 takes mb 1's input before sending mb 0's gradient back: rank 0 sends it first.
        ["RECV_F(stage=1, mb=0, from rank 0)", "F(stage=1, mb=0)", "RECV_F(stage=1, mb=1, from rank 0)", "B(stage=1, mb=0)",
         "SEND_B(stage=1, mb=0, to rank 0)", "F(stage=1, mb=1)", "B(stage=1, mb=1)", "RECV_F(stage=1, mb=2, from rank 0)",
         "SEND_B(stage=1, mb=1, to rank 0)", "F(stage=1, mb=2)", "B(stage=1, mb=2)", "SEND_B(stage=1, mb=2, to rank 0)"],
    ]


def test_zbv_hands_off_between_the_two_stages_of_one_rank():
    lowered = lower(build_schedule("zbv", 2, 2))
    assert lowered.stage_ranks == (0, 1, 1, 0) and check(lowered).ok
    assert _text(lowered) == [
        ["F(stage=0, mb=0)", "SEND_F(stage=0, mb=0, to rank 1)", "F(stage=0, mb=1)", "SEND_F(stage=0, mb=1, to rank 1)",
         "RECV_F(stage=3, mb=0, from rank 1)", "F(stage=3, mb=0)", "I(stage=3, mb=0)", "SEND_B(stage=3, mb=0, to rank 1)",
         "RECV_F(stage=3, mb=1, from rank 1)", "W(stage=3, mb=0)", "F(stage=3, mb=1)", "I(stage=3, mb=1)",
         "SEND_B(stage=3, mb=1, to rank 1)", "RECV_B(stage=0, mb=0, from rank 1)", "W(stage=3, mb=1)", "I(stage=0, mb=0)",
         "W(stage=0, mb=0)", "RECV_B(stage=0, mb=1, from rank 1)", "I(stage=0, mb=1)", "W(stage=0, mb=1)"],
        ["RECV_F(stage=1, mb=0, from rank 0)", "F(stage=1, mb=0)", "RECV_F(stage=1, mb=1, from rank 0)",
         "HANDOFF_F(stage=1, mb=0)", "F(stage=2, mb=0)", "SEND_F(stage=2, mb=0, to rank 0)", "F(stage=1, mb=1)",
         "HANDOFF_F(stage=1, mb=1)", "F(stage=2, mb=1)", "RECV_B(stage=2, mb=0, from rank 0)",
         "SEND_F(stage=2, mb=1, to rank 0)", "I(stage=2, mb=0)", "HANDOFF_B(stage=2, mb=0)", "W(stage=2, mb=0)",
         "I(stage=1, mb=0)", "RECV_B(stage=2, mb=1, from rank 0)", "SEND_B(stage=1, mb=0, to rank 0)", "W(stage=1, mb=0)",
         "I(stage=2, mb=1)", "HANDOFF_B(stage=2, mb=1)", "W(stage=2, mb=1)", "I(stage=1, mb=1)",
         "SEND_B(stage=1, mb=1, to rank 0)", "W(stage=1, mb=1)"],
    ]


def test_inputs_are_received_in_the_order_they_were_sent_whatever_order_the_consumer_runs_them():
    # Rank 1 runs mb 1 before mb 0: both inputs are received up front, in the sender's order.
    schedule = Schedule("h", 2, 1, 2, (0, 1), [
        [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(B, 0, 1)],
        [Action(F, 1, 1), Action(F, 1, 0), Action(B, 1, 0), Action(B, 1, 1)]])
    lowered = lower(schedule)
    assert check(lowered).ok
    assert _text(lowered)[1] == [
        "RECV_F(stage=1, mb=0, from rank 0)", "RECV_F(stage=1, mb=1, from rank 0)", "F(stage=1, mb=1)", "F(stage=1, mb=0)",
        "B(stage=1, mb=0)", "SEND_B(stage=1, mb=0, to rank 0)", "B(stage=1, mb=1)", "SEND_B(stage=1, mb=1, to rank 0)"]


def test_an_output_nobody_consumes_is_still_sent_when_it_is_produced():
    lowered = lower(Schedule("h", 2, 1, 1, (0, 1), [[Action(F, 0, 0)], []]))
    assert _text(lowered) == [["F(stage=0, mb=0)", "SEND_F(stage=0, mb=0, to rank 1)"], ["RECV_F(stage=1, mb=0, from rank 0)"]]
    assert "stage 1 mb 0 never runs F" in [str(v) for v in check(lowered).violations]


@pytest.mark.parametrize("ranks, microbatches, message", [
    ([[Action(F, 0, 0), Action(F, 0, 0)], []], 1,
     "F(stage=0, mb=0) appears twice. Fix: run each (stage, microbatch) once per kind"),
    ([[Action(F, 0, 1)], []], 1,
     "F(stage=0, mb=1) is outside the schedule's 2 stages and 1 microbatches. Fix: generate actions within those ranges"),
    ([[Action(F, 2, 0)], []], 1,
     "F(stage=2, mb=0) is outside the schedule's 2 stages and 1 microbatches. Fix: generate actions within those ranges"),
    ([[Action(B, 0, 0), Action(F, 0, 0)], [Action(F, 1, 0), Action(B, 1, 0)]], 1,
     "schedule 'h' cannot run even with free communication: every rank left waits for an input no rank will produce "
     "first:\n  rank 0 at step 0: B(stage=0, mb=0)\n  rank 1 at step 0: F(stage=1, mb=0)\nFix: reorder the compute lists "
     "so each input is produced before it is needed"),
])
def test_schedules_lowering_cannot_run_are_refused_with_the_reason(ranks, microbatches, message):
    with pytest.raises(ScheduleError) as refused:
        lower(Schedule("h", 2, 1, microbatches, (0, 1), ranks))
    assert str(refused.value) == message


def test_a_lowered_schedule_is_not_lowered_again():
    with pytest.raises(ScheduleError) as refused:
        lower(lower(build_schedule("1f1b", 2, 2)))
    assert str(refused.value) == ("schedule '1f1b' already holds communication actions. Fix: lower the compute-only "
                                  "schedule from rayshard.plans.pipeline.schedules.build_schedule")


def test_an_fb_sends_the_gradient_of_its_backward_half_when_its_forward_half_sends_nothing():
    # Unit costs F 1, B 2, FB 3: rank 1 runs F(1,0) at [1, 2] and the FB at [2, 5]; its B half's
    # gradient goes back at 5, when rank 0's B(0,0) needs it, before rank 1's B(1,1) starts.
    schedule = Schedule("h", 2, 1, 2, (0, 1), [
        [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(B, 0, 1)],
        [Action(F, 1, 0), Action(Kind.FB, 1, 1, backward_stage=1, backward_microbatch=0), Action(B, 1, 1)]])
    lowered = lower(schedule)
    assert check(lowered).ok
    assert _text(lowered) == [
        ["F(stage=0, mb=0)", "SEND_F(stage=0, mb=0, to rank 1)", "F(stage=0, mb=1)", "SEND_F(stage=0, mb=1, to rank 1)",
         "RECV_B(stage=0, mb=0, from rank 1)", "B(stage=0, mb=0)", "RECV_B(stage=0, mb=1, from rank 1)", "B(stage=0, mb=1)"],
        ["RECV_F(stage=1, mb=0, from rank 0)", "F(stage=1, mb=0)", "RECV_F(stage=1, mb=1, from rank 0)",
         "FB(stage=1, mb=1 | B stage=1, mb=0)", "SEND_B(stage=1, mb=0, to rank 0)", "B(stage=1, mb=1)",
         "SEND_B(stage=1, mb=1, to rank 0)"],
    ]


def test_an_fb_waits_for_the_inputs_of_its_backward_half_too():
    # Rank 0's FB runs F(0,1), which needs nothing, and B(0,0), which needs rank 1's gradient of
    # B(1,0): the FB starts only after it, so RECV_B(0,0) comes before the FB, not after.
    schedule = Schedule("h", 2, 1, 2, (0, 1), [
        [Action(F, 0, 0), Action(Kind.FB, 0, 1, backward_stage=0, backward_microbatch=0), Action(B, 0, 1)],
        [Action(F, 1, 0), Action(B, 1, 0), Action(F, 1, 1), Action(B, 1, 1)]])
    lowered = lower(schedule)
    assert check(lowered).ok
    assert _text(lowered) == [
        ["F(stage=0, mb=0)", "SEND_F(stage=0, mb=0, to rank 1)", "RECV_B(stage=0, mb=0, from rank 1)",
         "FB(stage=0, mb=1 | B stage=0, mb=0)", "SEND_F(stage=0, mb=1, to rank 1)", "RECV_B(stage=0, mb=1, from rank 1)",
         "B(stage=0, mb=1)"],
        ["RECV_F(stage=1, mb=0, from rank 0)", "F(stage=1, mb=0)", "B(stage=1, mb=0)", "SEND_B(stage=1, mb=0, to rank 0)",
         "RECV_F(stage=1, mb=1, from rank 0)", "F(stage=1, mb=1)", "B(stage=1, mb=1)", "SEND_B(stage=1, mb=1, to rank 0)"],
    ]


def test_a_transfer_waits_until_neither_rank_is_mid_compute_but_no_later_than_it_is_needed():
    # GPipe on two ranks, 3 microbatches; F(1,0) and B(0,0) take 3, everything else 1. Timeline by
    # hand: rank 0 F at [0,1] [1,2] [2,3], B at [7,10] [10,11] [11,12]; rank 1 F(1,0) at [1,4],
    # F at [4,5] [5,6], B at [6,7] [7,8] [8,9]. F(0,1)'s output exists at 2 and F(0,2)'s at 3, but
    # rank 1 is inside F(1,0) until 4: both go at 4, after F(0,2). B(1,1)'s and B(1,2)'s gradients
    # exist at 8 and 9, but rank 0 is inside B(0,0) until 10: both go at 10, after B(1,2).
    schedule = Schedule("h", 2, 1, 3, (0, 1), [
        [Action(F, 0, 0), Action(F, 0, 1), Action(F, 0, 2), Action(B, 0, 0), Action(B, 0, 1), Action(B, 0, 2)],
        [Action(F, 1, 0), Action(F, 1, 1), Action(F, 1, 2), Action(B, 1, 0), Action(B, 1, 1), Action(B, 1, 2)]])
    long = {Action(F, 1, 0), Action(B, 0, 0)}
    lowered = lower(schedule, duration=lambda action: 3.0 if action in long else 1.0)
    assert check(lowered).ok
    assert _text(lowered) == [
        ["F(stage=0, mb=0)", "SEND_F(stage=0, mb=0, to rank 1)", "F(stage=0, mb=1)", "F(stage=0, mb=2)",
         "SEND_F(stage=0, mb=1, to rank 1)", "SEND_F(stage=0, mb=2, to rank 1)", "RECV_B(stage=0, mb=0, from rank 1)",
         "B(stage=0, mb=0)", "RECV_B(stage=0, mb=1, from rank 1)", "RECV_B(stage=0, mb=2, from rank 1)",
         "B(stage=0, mb=1)", "B(stage=0, mb=2)"],
        ["RECV_F(stage=1, mb=0, from rank 0)", "F(stage=1, mb=0)", "RECV_F(stage=1, mb=1, from rank 0)",
         "RECV_F(stage=1, mb=2, from rank 0)", "F(stage=1, mb=1)", "F(stage=1, mb=2)", "B(stage=1, mb=0)",
         "SEND_B(stage=1, mb=0, to rank 0)", "B(stage=1, mb=1)", "B(stage=1, mb=2)", "SEND_B(stage=1, mb=1, to rank 0)",
         "SEND_B(stage=1, mb=2, to rank 0)"],
    ]
