import pytest
from hypothesis import given, settings, strategies as st

from rayshard.cluster.cli.main import main
from rayshard.plans.config import ModelChoice, PipelineConfig, TrainConfig
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.chooser import Workload, choose_layout, estimate_memory
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import preset

GIB = 2 ** 30


def test_small_model_prefers_data_parallelism_and_explains():
    choice = choose_layout(8, preset("small"), Workload(16, 256), 80 * GIB)
    assert choice.layout == ParallelLayout(dp=8)
    assert "dp=8: replicas fit" in choice.explain()


def test_six_ranks_and_one_microbatch_use_four_data_ranks_not_an_idle_pipeline():
    choice = choose_layout(6, preset("small"), Workload(16, 256, 1), 80 * GIB)
    assert choice.layout == ParallelLayout(dp=4)
    assert "uses 4 of 6 ranks" in choice.explain()


def test_tight_memory_moves_to_sharding_then_model_parallelism():
    model, work = preset("small"), Workload(16, 256)
    replicated = estimate_memory(model, ParallelLayout(dp=4), work).total
    sharded = choose_layout(4, model, work, replicated * 0.8)
    assert sharded.layout.fsdp > 1 or sharded.layout.tp > 1
    assert sharded.estimate.total <= replicated * 0.8
    if sharded.layout.tp == 1 and sharded.layout.pp == 1:  # the reasons agree: sharded because replicas do not fit
        explained = sharded.explain()
        assert f"fits once sharded over the {sharded.layout.fsdp} fsdp ranks" in explained, explained
        assert "fits on every data rank" not in explained, explained


def test_pins_are_honoured_and_impossible_requests_say_why():
    choice = choose_layout(8, preset("small"), Workload(16, 256), 80 * GIB, pinned={"tp": 2})
    assert choice.layout.tp == 2 and "pinned by you: tp=2" in choice.explain()
    with pytest.raises(ConfigError, match="fits 0.00 GiB per rank"):
        choose_layout(8, preset("small"), Workload(16, 256), 1024)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 16), st.sampled_from([4, 8, 12, 16, 24]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([1, 2]))
def test_every_choice_is_a_valid_training_config(ranks, batch, microbatches, ranks_per_node, vpp):
    """80 GiB holds the small model on one rank, so a layout always exists: the chooser must find
    one (a ConfigError fails this test), and every choice, pipelines included, must pass the
    validation training applies."""
    model = preset("small")
    choice = choose_layout(ranks, model, Workload(batch, 64, microbatches), 80 * GIB, ranks_per_node=ranks_per_node, vpp=vpp)
    layout = choice.layout
    assert layout.world_size <= ranks and layout.tp <= ranks_per_node
    assert batch % (layout.data_parallel_size * microbatches) == 0
    schedule = "interleaved1f1b" if layout.vpp > 1 else "1f1b"
    TrainConfig(model=ModelChoice("small", model), layout=layout, global_batch=batch, seq_len=64,
                pipeline=PipelineConfig(schedule=schedule, microbatches=microbatches)).validate()


def test_pipelines_are_chosen_when_memory_needs_them_and_validate():
    """A budget that only a pipeline meets: the choice has pp > 1 and trains as configured."""
    model, work = preset("small"), Workload(16, 256, 8)
    choice = choose_layout(4, model, work, estimate_memory(model, ParallelLayout(pp=4), work).total, ranks_per_node=1)
    assert choice.layout.pp > 1 and choice.layout.tp == 1  # tp=1: one rank per node
    assert f"pp={choice.layout.pp}" in choice.explain()
    TrainConfig(model=ModelChoice("small", model), layout=choice.layout, global_batch=16, seq_len=256,
                pipeline=PipelineConfig(microbatches=8)).validate()


def test_plan_layout_cli(capsys):
    assert main(["plan", "layout", "--ranks", "6", "--model", "small"]) == 0
    out = capsys.readouterr().out
    assert "dp4" in out and "memory per rank" in out


def test_snapshots_in_memory_count_in_a_host_budget_and_are_reported_beside_a_device_one():
    """Issue 41: the layout chooser counts a snapshot's host memory (decision 165): two staging
    buffers and the keepers' copies, 8 shares of the rank's saved state (12 bytes a parameter)."""
    model, replicas = preset("small"), ParallelLayout(dp=4)
    plain = estimate_memory(model, replicas, Workload(16, 256))
    on_host = estimate_memory(model, replicas, Workload(16, 256, snapshots=True))
    assert plain.snapshot_host == 0 and on_host.total > plain.total
    assert on_host.snapshot_host == pytest.approx(8 * 12 / 16 * plain.model_state, rel=0.05)  # replicas: no gathering
    budget = (plain.total + on_host.total) / 2  # replicas fit without snapshots, not with them
    assert choose_layout(4, model, Workload(16, 256), budget).layout == replicas
    choice = choose_layout(4, model, Workload(16, 256, snapshots=True), budget)
    assert choice.layout != replicas and choice.estimate.total <= budget
    assert "snapshots in memory ~" in choice.explain() and "counted in the budget" in choice.explain()
    on_device = choose_layout(4, model, Workload(16, 256, snapshots=True, host_budget=False), budget)
    assert on_device.layout == replicas and "besides the device budget" in on_device.explain()
