"""Precision, activation checkpointing and compile: what the config accepts and refuses."""
from __future__ import annotations

import pytest

from rayshard.plans.config import NumericsConfig, PipelineConfig, TrainConfig
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout


def _config(layout=ParallelLayout(), schedule="1f1b", microbatches=1, global_batch=8, **numerics) -> TrainConfig:
    return TrainConfig(layout=layout, global_batch=global_batch,
                       pipeline=PipelineConfig(schedule=schedule, microbatches=microbatches),
                       numerics=NumericsConfig(**numerics))


@pytest.mark.parametrize("schedule, title", [("zbh1", "ZB-H1"), ("zbv", "ZB-V"), ("dualpipev", "DualPipeV")])
def test_compile_is_refused_with_schedules_that_split_the_backward(schedule, title):
    vpp = 1 if schedule == "zbh1" else 2
    with pytest.raises(ConfigError, match=f"the {title} schedule splits each stage's backward") as caught:
        _config(layout=ParallelLayout(pp=2, vpp=vpp), schedule=schedule, microbatches=4, global_batch=8,
                compile=True).validate()
    assert "--schedule 1f1b" in str(caught.value)


@pytest.mark.parametrize("schedule, vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2)])
def test_compile_composes_with_schedules_that_keep_the_backward_whole(schedule, vpp):
    _config(layout=ParallelLayout(pp=2, vpp=vpp), schedule=schedule, microbatches=4, global_batch=8,
            compile=True).validate()


def test_compile_without_a_pipeline_ignores_the_schedule():
    _config(schedule="zbh1", compile=True).validate()  # pp == 1 runs no schedule


def test_unknown_precision_and_ac_name_the_field_and_the_choices():
    with pytest.raises(ConfigError, match=r"precision.*'fp16'.*\['fp32', 'bf16'\]"):
        _config(precision="fp16").validate()
    with pytest.raises(ConfigError, match=r"ac.*'some'.*\['none', 'full', 'selective'\]"):
        _config(ac="some").validate()


def test_precision_flags_reach_the_config():
    from rayshard.cluster.cli.commands.train import config_from_args
    from rayshard.cluster.cli.main import build_parser

    args = build_parser().parse_args(["train", "--precision", "bf16", "--ac", "selective", "--compile",
                                      "--tensorboard"])
    config = config_from_args(args)
    assert (config.numerics.precision, config.numerics.ac, config.numerics.compile,
            config.metrics.tensorboard) == ("bf16", "selective", True, True)
    defaults = config_from_args(build_parser().parse_args(["train"]))
    assert (defaults.numerics.precision, defaults.numerics.ac, defaults.numerics.compile) == ("fp32", "none", False)
