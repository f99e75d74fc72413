"""The simulator reproduces the closed forms of ../shared/ANCHORS.md exactly, and models
memory, communication and measured costs."""
from __future__ import annotations

import pytest

from rayshard.plans.pipeline.actions import Kind
from rayshard.plans.errors import ConfigError, ScheduleError
from rayshard.plans.pipeline.lowering import lower
from rayshard.plans.pipeline.text_grid import text_grid
from rayshard.plans.pipeline.schedules import build_schedule
from rayshard.plans.pipeline.simulator import PipelineCosts, costs_from_measurements, simulate, simulate_measured

SHAPES = [(2, 1), (2, 5), (3, 7), (4, 4), (4, 8), (5, 13), (8, 8), (8, 32)]


def run(name, pp, microbatches, vpp=None, forward=1.0, backward=2.0, weight=1.0, comm="async", **extra):
    """Simulate with costs given for one rank's share of the model (split over its vpp stages)."""
    schedule = build_schedule(name, pp, microbatches, vpp)
    share = 1.0 / schedule.vpp
    costs = PipelineCosts.uniform(
        schedule.num_stages, forward * share, backward * share, weight * share,
        activation_bytes=share, **extra,
    )
    return simulate(lower(schedule, costs.duration), costs, comm=comm)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, microbatches", SHAPES)
@pytest.mark.parametrize("forward, backward", [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, pp, microbatches, forward, backward):
    for comm in ("async", "rendezvous"):
        simulation = run(name, pp, microbatches, forward=forward, backward=backward, comm=comm)
        assert simulation.bubble_fraction == pytest.approx((pp - 1) / (microbatches + pp - 1), abs=1e-12)
        assert simulation.step_time == pytest.approx((microbatches + pp - 1) * (forward + backward))


@pytest.mark.parametrize("pp, microbatches", SHAPES)
def test_1f1b_stage_i_holds_min_p_minus_i_m_microbatches(pp, microbatches):
    peaks = run("1f1b", pp, microbatches).peak_memory
    assert peaks == [min(pp - stage, microbatches) for stage in range(pp)]


@pytest.mark.parametrize("pp, microbatches", SHAPES)
def test_gpipe_holds_every_microbatch(pp, microbatches):
    assert run("gpipe", pp, microbatches).peak_memory == [microbatches] * pp


@pytest.mark.parametrize("pp, microbatches", [(2, 2), (3, 9), (4, 8), (4, 16), (6, 12), (8, 8), (8, 32)])
def test_zbh1_bubble_is_a_third_of_1f1b_at_no_more_memory_than_1f1b_rank_0(pp, microbatches):
    # F = I = W = 1: 1F1B idles (p-1)(F+B) = 3(p-1) per rank, ZB-H1 (p-1)(F+I-W) = p-1.
    zbh1, one_f_one_b = run("zbh1", pp, microbatches), run("1f1b", pp, microbatches)
    assert sum(zbh1.idle) / sum(one_f_one_b.idle) == pytest.approx(1 / 3)
    assert zbh1.idle == pytest.approx([pp - 1] * pp)
    assert max(zbh1.peak_memory) <= one_f_one_b.peak_memory[0]
    assert zbh1.bubble_fraction < one_f_one_b.bubble_fraction


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("vpp", [2, 3])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_interleaved_bubble_is_p_minus_1_over_v_m_of_ideal_time(pp, vpp, rounds):
    microbatches = rounds * pp
    simulation = run("interleaved1f1b", pp, microbatches, vpp)
    ideal = max(simulation.busy)
    assert (simulation.step_time - ideal) / ideal == pytest.approx((pp - 1) / (vpp * microbatches))


@pytest.mark.parametrize("pp, microbatches", [(2, 4), (3, 6), (4, 8), (4, 13), (8, 16), (8, 32)])
def test_zbv_idles_only_through_the_unavoidable_warm_up_at_1f1b_memory(pp, microbatches):
    # The last rank cannot start before microbatch 0 crossed pp - 1 chunks: (p-1) * F / 2.
    simulation = run("zbv", pp, microbatches)
    assert simulation.idle == pytest.approx([(pp - 1) * 0.5] * pp)
    assert max(simulation.peak_memory) <= run("1f1b", pp, microbatches).peak_memory[0]


@pytest.mark.parametrize("pp, microbatches", [(2, 4), (3, 7), (4, 8), (4, 11), (8, 16), (8, 32)])
def test_dualpipev_bubble_is_p_minus_1_times_fb_plus_b_minus_3w(pp, microbatches):
    # DeepSeek's DualPipeV bubble in chunk costs (F = W = 1/2, full B = 1), with F&B = F + B
    # when nothing overlaps. Exact at equal costs; other ratios land within (p-1)/2 of it.
    simulation = run("dualpipev", pp, microbatches)
    chunk_f, chunk_b, chunk_w = 0.5, 1.0, 0.5
    expected = (pp - 1) * ((chunk_f + chunk_b) + chunk_b - 3 * chunk_w)
    assert simulation.idle == pytest.approx([expected] * pp)
    # p + 1/2 microbatches of one rank's share: 2p + 1 half-size chunk activations.
    assert max(simulation.peak_memory) == pytest.approx(pp + 0.5)


def test_overlap_shortens_dualpipev():
    assert run("dualpipev", 4, 12, overlap=0.5).step_time < run("dualpipev", 4, 12).step_time


def test_communication_costs_time_and_rendezvous_costs_more():
    free = run("1f1b", 4, 8)
    schedule = build_schedule("1f1b", 4, 8)
    costs = PipelineCosts.uniform(4, comm=0.25)
    lowered = lower(schedule, costs.duration)
    slow_async, slow_blocking = simulate(lowered, costs, "async"), simulate(lowered, costs, "rendezvous")
    assert free.step_time < slow_async.step_time <= slow_blocking.step_time
    # The first microbatch crosses 3 links forward and 3 back: at least 6 transfers longer.
    assert slow_async.step_time >= free.step_time + 6 * 0.25 - 1e-9
    transfers = [
        end - start
        for actions, starts, ends in zip(lowered.ranks, slow_blocking.starts, slow_blocking.ends)
        for action, start, end in zip(actions, starts, ends)
        if action.kind is Kind.SEND_F
    ]
    assert transfers and all(t == pytest.approx(0.25) for t in transfers)


def test_input_grad_can_free_part_of_the_activations():
    schedule = lower(build_schedule("zbh1", 4, 8))
    conservative = simulate(schedule).peak_memory
    eager = simulate(schedule, PipelineCosts.uniform(4, input_grad_frees=0.75)).peak_memory
    assert all(e <= c for e, c in zip(eager, conservative)) and eager != conservative


def test_memory_timeline_returns_to_zero():
    simulation = simulate(lower(build_schedule("dualpipev", 3, 6)))
    for timeline in simulation.memory:
        assert timeline[-1][1] == pytest.approx(0.0)
        assert all(held >= -1e-12 for _, held in timeline)


def test_measured_durations_reproduce_costs_and_average_back():
    schedule = build_schedule("zbh1", 3, 6)
    costs = PipelineCosts.uniform(3, forward=1.0, backward=3.0, weight_grad=1.0)
    lowered = lower(schedule, costs.duration)
    measured = {
        (action.kind.value, action.stage, action.microbatch): costs.duration(action)
        for actions in lowered.ranks for action in actions if action.is_compute
    }
    by_table = simulate_measured(lowered, measured)
    assert by_table.starts == simulate(lowered, costs).starts
    assert simulate_measured(lowered, costs.duration).step_time == by_table.step_time
    averaged = costs_from_measurements(measured, 3)
    assert averaged.stages[1].forward == 1.0 and averaged.stages[1].input_grad == 2.0
    del measured["F", 0, 0]
    with pytest.raises(ConfigError, match="no measured time"):
        simulate_measured(lowered, measured)


def test_costs_text():
    costs = PipelineCosts.parse("F=1,B=2,W=1", 4)
    assert (costs.stages[0].forward, costs.stages[0].input_grad, costs.stages[0].weight_grad) == (1, 1, 1)
    halves = PipelineCosts.parse("F=1,I=1.5,W=0.5,C=0.1", 4, vpp=2)
    assert halves.stages[3].backward == 1.0 and halves.stages[3].comm == 0.1
    assert PipelineCosts.parse("", 2).stages[0].backward == 2.0
    with pytest.raises(ConfigError, match="KEY=NUMBER"):
        PipelineCosts.parse("F:1", 2)
    with pytest.raises(ConfigError, match="I \\+ W"):
        PipelineCosts.parse("B=2,I=1,W=2", 2)


def test_simulator_refuses_unlowered_plans():
    with pytest.raises(ScheduleError, match="lower"):
        simulate(build_schedule("1f1b", 2, 2))


def test_text_grid():
    grid = text_grid(simulate(lower(build_schedule("1f1b", 2, 2))))
    assert grid.splitlines() == [
        "rank 0  |F0 F1 .  .  B0--- .  B1---",
        "rank 1  |.  F0 B0--- F1 B1--- .  .",
    ]
    wide = text_grid(simulate(lower(build_schedule("gpipe", 8, 64))), max_slots=100)
    assert "grid omitted" in wide
