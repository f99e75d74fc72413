"""Schedules as data: generation, microbatch rules, JSON round trips, and the properties every
schedule must have after lowering (checker passes, each (stage, mb) computed exactly once per
kind, memory within the schedule's stated bound)."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayshard.plans.pipeline.actions import Action, Kind, Schedule
from rayshard.plans.pipeline.checker import check
from rayshard.plans.errors import ConfigError, ScheduleError
from rayshard.plans.pipeline.lowering import lower
from rayshard.plans.pipeline.schedules import SPECS, build_schedule, memory_bounds, schedule_spec, valid_microbatch_counts
from rayshard.plans.pipeline.simulator import PipelineCosts, simulate

F, B, I, W, FB = Kind.F, Kind.B, Kind.I, Kind.W, Kind.FB  # noqa: E741


def compute_counts(schedule: Schedule) -> Counter:
    counts: Counter = Counter()
    for actions in schedule.ranks:
        for action in actions:
            for part in action.parts():
                if part.kind in (F, B, I, W):
                    counts[part.kind, part.stage, part.microbatch] += 1
    return counts


def assert_each_stage_microbatch_once(schedule: Schedule) -> None:
    counts = compute_counts(schedule)
    for stage in range(schedule.num_stages):
        for mb in range(schedule.microbatches):
            assert counts[F, stage, mb] == 1, (stage, mb)
            full, split = counts[B, stage, mb], (counts[I, stage, mb], counts[W, stage, mb])
            assert (full, split) in ((1, (0, 0)), (0, (1, 1))), (stage, mb, full, split)
    expected = schedule.num_stages * schedule.microbatches
    assert sum(counts.values()) in range(2 * expected, 3 * expected + 1)


@st.composite
def pipelines(draw, name: str):
    spec = SPECS[name]
    pp = draw(st.integers(2, 8))
    vpp = draw(st.integers(1, 3)) if not spec.fixed_vpp else spec.default_vpp
    microbatches = draw(st.sampled_from(valid_microbatch_counts(name, pp, vpp, up_to=4 * pp)))
    return pp, vpp, microbatches


@st.composite
def costs(draw):
    forward = draw(st.sampled_from([0.5, 1.0, 1.5, 2.0]))
    backward = draw(st.sampled_from([1.0, 2.0, 3.0]))
    weight = draw(st.sampled_from([0.25, 0.5])) * backward
    return forward, backward, weight


@pytest.mark.parametrize("name", list(SPECS))
@settings(max_examples=35, deadline=None)
@given(data=st.data())
def test_every_schedule_lowers_to_a_checked_plan_within_its_memory_bound(name, data):
    pp, vpp, microbatches = data.draw(pipelines(name))
    forward, backward, weight = data.draw(costs())
    schedule = build_schedule(name, pp, microbatches, vpp)
    assert_each_stage_microbatch_once(schedule)

    stage_costs = PipelineCosts.uniform(schedule.num_stages, forward, backward, weight)
    # Any expected timeline yields a deadlock-free order: lower with the drawn costs.
    lowered = lower(schedule, stage_costs.duration)
    report = check(lowered)
    assert report.ok, report.describe()
    assert [[a for a in actions if a.is_compute] for actions in lowered.ranks] == schedule.ranks

    fast = simulate(lowered, stage_costs, comm="async", checked=report)
    for rank, (peak, bound) in enumerate(zip(fast.peak_memory, memory_bounds(schedule))):
        assert peak <= bound, f"rank {rank}: peak {peak} > bound {bound}"
    # Blocking transfers can only add waiting.
    strict = simulate(lowered, stage_costs, comm="rendezvous", checked=report)
    assert strict.step_time >= fast.step_time - 1e-9
    assert Schedule.from_dict(json.loads(json.dumps(lowered.to_dict()))) == lowered


def test_memory_bounds_are_tight_for_enough_microbatches():
    for name in SPECS:
        schedule = lower(build_schedule(name, 4, 16))
        peaks = simulate(schedule).peak_memory
        assert peaks == [float(bound) for bound in memory_bounds(schedule)], name


def test_1f1b_order_on_a_small_pipeline():
    ranks = build_schedule("1f1b", 2, 3).ranks
    assert ranks[0] == [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(F, 0, 2), Action(B, 0, 1), Action(B, 0, 2)]
    assert ranks[1] == [Action(F, 1, 0), Action(B, 1, 0), Action(F, 1, 1), Action(B, 1, 1), Action(F, 1, 2), Action(B, 1, 2)]


def test_zbh1_defers_weight_grads_on_later_ranks():
    ranks = build_schedule("zbh1", 4, 8).ranks
    first_w = [next(i for i, a in enumerate(actions) if a.kind is W) for actions in ranks]
    first_i = [next(i for i, a in enumerate(actions) if a.kind is I) for actions in ranks]
    lags = [w - i for w, i in zip(first_w, first_i)]
    assert lags == sorted(lags) and lags[0] == 1 and lags[-1] > 1


def test_placements():
    assert build_schedule("1f1b", 4, 4).stage_ranks == (0, 1, 2, 3)
    assert build_schedule("interleaved1f1b", 4, 8, 2).stage_ranks == (0, 1, 2, 3, 0, 1, 2, 3)
    for name in ("zbv", "dualpipev"):
        assert build_schedule(name, 4, 8).stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)


def test_dualpipev_overlaps_forward_and_backward_of_different_stages():
    schedule = build_schedule("dualpipev", 4, 12)
    pairs = [a for actions in schedule.ranks for a in actions if a.kind is FB]
    assert pairs
    for pair in pairs:
        forward, backward = pair.parts()
        assert (forward.kind, backward.kind) == (F, B)
        assert schedule.rank_of(forward.stage) == schedule.rank_of(backward.stage)
        assert forward.stage != backward.stage


def test_v_schedules_hand_off_inside_the_turning_rank():
    lowered = lower(build_schedule("zbv", 4, 8))
    handoffs = {a.kind for a in lowered.ranks[3] if a.kind in (Kind.HANDOFF_F, Kind.HANDOFF_B)}
    assert handoffs == {Kind.HANDOFF_F, Kind.HANDOFF_B}
    assert not any(a.peer == 3 for a in lowered.ranks[3])


@pytest.mark.parametrize(
    "name, pp, microbatches, vpp, message",
    [
        ("dualpipev", 4, 6, None, "at least 2 \\* pp = 8 microbatches. Fix: use one of 8, 9"),
        ("interleaved1f1b", 4, 9, 2, "equal rounds. Fix: use one of .*8, 10"),
        ("gpipe", 4, 0, None, "any count >= 1"),
    ],
)
def test_unservable_microbatch_counts_name_the_ones_that_work(name, pp, microbatches, vpp, message):
    with pytest.raises(ScheduleError, match=message):
        build_schedule(name, pp, microbatches, vpp)


def test_bad_vpp_and_names_are_explained():
    with pytest.raises(ConfigError, match="exactly 2 stage"):
        build_schedule("zbv", 4, 8, vpp=3)
    with pytest.raises(ConfigError, match="exactly 1 stage"):
        build_schedule("1f1b", 4, 8, vpp=2)
    with pytest.raises(ScheduleError, match="unknown schedule 'zb2'.*gpipe"):
        build_schedule("zb2", 4, 8)


def test_names_and_aliases():
    assert schedule_spec("i1f1b").name == "interleaved1f1b"
    assert schedule_spec("ZB-H1").name == "zbh1"
    assert schedule_spec("DualPipeV").name == "dualpipev"


def test_interleaved_with_one_chunk_is_1f1b():
    assert build_schedule("interleaved1f1b", 4, 8, 1).ranks == build_schedule("1f1b", 4, 8).ranks


def test_action_dicts_round_trip_and_reject_nonsense():
    pair = Action(FB, 0, 3, None, 7, 1)
    assert Action.from_dict(pair.to_dict()) == pair
    send = Action(Kind.SEND_F, 2, 5, 3)
    assert send.to_dict() == {"kind": "SEND_F", "stage": 2, "microbatch": 5, "peer": 3}
    assert Action.from_dict(send.to_dict()) == send
    with pytest.raises(ScheduleError, match="need a 'peer'"):
        Action.from_dict({"kind": "SEND_F", "stage": 0, "microbatch": 0})
    with pytest.raises(ScheduleError, match="kind"):
        Action.from_dict({"kind": "X", "stage": 0, "microbatch": 0})


def test_lowering_rejects_a_compute_order_that_cannot_run():
    schedule = Schedule("bad", 2, 1, 1, (0, 1), [[Action(B, 0, 0), Action(F, 0, 0)], [Action(F, 1, 0), Action(B, 1, 0)]])
    with pytest.raises(ScheduleError, match="cannot run even with free communication"):
        lower(schedule)
