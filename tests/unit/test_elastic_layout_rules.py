"""An elastic recovery picks only layouts the run's own settings accept.

Before, the chooser knew the model and the batch but not the run: with `--sp` it could pick tp 1,
with a pipeline order from a file another pp, and the attempt then died in validation."""
from __future__ import annotations

import pytest

from rayshard.cluster.run.elastic import layout_chooser_for, runs_on
from rayshard.plans.config import (ModelChoice, NumericsConfig, OptimizerConfig, PipelineConfig, ResourcesConfig,
                                   TrainConfig)
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.chooser import Workload, choose_layout
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import preset

GIB = 2**30


def _config(**overrides) -> TrainConfig:
    values = dict(model=ModelChoice.named("tiny"), layout=ParallelLayout(), steps=4, global_batch=8, seq_len=32,
                  optimizer=OptimizerConfig(), store="/tmp/unused", run="t")
    values.update(overrides)
    return TrainConfig(**values)


def test_without_run_rules_the_chooser_takes_tp_1():
    # The premise of the tests below: on 4 ranks the tiny model's preferred layout is dp4.
    assert choose_layout(4, preset("tiny"), Workload(8, 32), 64 * GIB).layout == ParallelLayout(dp=4)


def test_sequence_parallel_keeps_a_tensor_parallel_layout():
    config = _config(layout=ParallelLayout(tp=2, dp=2), numerics=NumericsConfig(sequence_parallel=True)).validate()
    for ranks in (2, 3, 4, 8):
        chosen = layout_chooser_for(config, {}, 64 * GIB, ranks_per_node=8)(ranks).layout
        assert chosen.tp > 1, (ranks, chosen)
        assert runs_on(config, chosen)


def test_a_pipeline_order_from_a_file_keeps_its_pp_and_vpp():
    # Interleaved 1F1B over 2 ranks, 2 stages each, 2 microbatches, written as torch's CSV rows.
    rows = (("0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"),
            ("1F0", "1F1", "3F0", "3F1", "3B0", "3B1", "1B0", "1B1"))
    config = _config(layout=ParallelLayout(pp=2, vpp=2), pipeline=PipelineConfig(microbatches=2, schedule_csv=rows)).validate()
    for ranks in (2, 4, 6):
        chosen = layout_chooser_for(config, {}, 64 * GIB, ranks_per_node=8)(ranks).layout
        assert (chosen.pp, chosen.vpp) == (2, 2), (ranks, chosen)
        assert runs_on(config, chosen)


def test_nothing_accepted_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"the run's settings refuse all \d+ layouts"):
        choose_layout(4, preset("tiny"), Workload(8, 32), 64 * GIB, accepts=lambda layout: False)


def test_runs_on_ignores_a_world_size_cross_check_of_the_old_layout():
    config = _config(layout=ParallelLayout(dp=2), resources=ResourcesConfig(world_size=2)).validate()
    assert runs_on(config, ParallelLayout(dp=4))
    sequence_parallel = _config(numerics=NumericsConfig(sequence_parallel=True), layout=ParallelLayout(tp=2))
    assert not runs_on(sequence_parallel, ParallelLayout(dp=4))
