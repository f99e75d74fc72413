"""Pipeline settings are checked before anything starts, and measured costs feed the simulator."""
import json

import pytest

from rayshard.cluster.cli.plan import register  # noqa: F401  (the CLI under test)
from rayshard.plans.config import ModelChoice, PipelineConfig, TrainConfig
from rayshard.plans.errors import ConfigError, ScheduleError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import preset
from rayshard.plans.pipeline.plan import build_pipeline_plan
from rayshard.plans.pipeline.schedules import schedule_for_vpp


def _config(layout=ParallelLayout(pp=2), **pipeline):
    return TrainConfig(model=ModelChoice.named("tiny"), layout=layout, global_batch=8,
                       pipeline=PipelineConfig(**{"microbatches": 4, **pipeline}))


@pytest.mark.parametrize("overrides, error, fragment", [
    (dict(schedule="zbv"), ConfigError, "layout.vpp=1: the ZB-V schedule runs exactly 2 stage(s) per rank. Fix: use --vpp 2"),
    (dict(schedule="1f1b", layout=ParallelLayout(pp=2, vpp=2)), ConfigError, "use --vpp 1"),
    (dict(schedule="dualpipev", layout=ParallelLayout(pp=2, vpp=2), microbatches=2), ConfigError, "at least 2 * pp = 4"),
    (dict(schedule="zbh2"), ScheduleError, "unknown schedule 'zbh2'"),
    (dict(stage_layout=(1, 1, 2)), ConfigError, "stage_layout=(1, 1, 2): has 3 stages but pp=2 x vpp=1 needs 2"),
    (dict(stage_layout=(1, 2)), ConfigError, "the model has 4"),
    (dict(layout=ParallelLayout(), stage_layout=(2, 2)), ConfigError, "only applies to pipelines"),
])
def test_pipeline_settings_fail_with_a_fix(overrides, error, fragment):
    with pytest.raises(error, match=None) as raised:
        _config(**overrides).validate()
    assert fragment in str(raised.value)


@pytest.mark.parametrize("schedule, vpp", [("gpipe", 1), ("1f1b", 1), ("interleaved1f1b", 2), ("zbh1", 1),
                                           ("zbv", 2), ("dualpipev", 2)])
def test_every_schedule_plans_for_training(schedule, vpp):
    config = _config(schedule=schedule, layout=ParallelLayout(pp=2, vpp=vpp)).validate()
    plan = build_pipeline_plan(config.model.spec, config.layout, config.pipeline.schedule, config.pipeline.microbatches)
    assert plan.schedule.is_lowered and plan.partition.num_stages == 2 * vpp
    assert plan.partition.stage_ranks == plan.schedule.stage_ranks
    assert sorted(layer for layers in plan.partition.stage_layers for layer in layers) == list(range(4))


def _timings_file(tmp_path, schedule="1f1b", pp=2, vpp=1, microbatches=4):
    plan = build_pipeline_plan(preset("tiny"), ParallelLayout(pp=pp, vpp=vpp), schedule, microbatches)
    cost = {"F": 0.01, "B": 0.02, "I": 0.01, "W": 0.01}
    actions = [[a.kind.value, a.stage, a.microbatch, cost[a.kind.value]]
               for actions in plan.schedule.ranks for a in actions if a.kind.value in cost]
    record = {"schedule": schedule, "layout": {"pp": pp, "vpp": vpp}, "microbatches": microbatches,
              "median_plan_seconds": 0.2, "median_step_seconds": 0.25, "actions": actions}
    path = tmp_path / "run" / "pipeline_timings.json"
    path.parent.mkdir()
    path.write_text(json.dumps(record))
    return path


def test_plan_schedule_replays_a_runs_measured_costs(tmp_path, capsys):
    from rayshard.cluster.cli.main import main

    _timings_file(tmp_path)
    assert main(["plan", "schedule", "--costs-from", "run", "--store", str(tmp_path), "--no-grid"]) == 0
    out = capsys.readouterr().out
    assert "costs measured by 1f1b pp=2 vpp=1 m=4" in out and "every action's own median time" in out
    # 1F1B on 2 ranks, 4 microbatches, F=10 ms, B=20 ms: (4 + 1) * 30 ms = 0.15 s.
    assert "measured plan time 0.2 s (median), simulated 0.15 s: simulated/measured 0.750" in out


def test_measured_costs_predict_other_schedules(tmp_path, capsys):
    from rayshard.cluster.cli.main import main

    path = _timings_file(tmp_path)
    assert main(["plan", "schedule", "--costs-from", str(path), "--schedule", "zbv", "--no-grid"]) == 0
    out = capsys.readouterr().out
    assert "per-stage means rescaled to 4 stages" in out and "F=0.005 B=0.01" in out


def test_costs_from_a_missing_run_says_where_it_looked(tmp_path, capsys):
    from rayshard.cluster.cli.main import main

    assert main(["plan", "schedule", "--costs-from", "nope", "--store", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert f"no pipeline_timings.json found (looked at nope/pipeline_timings.json, {tmp_path}/nope/pipeline_timings.json)" in error
    assert "Fix: name a run trained with --pp 2 or more" in error


@pytest.mark.parametrize("schedule, vpp, expected", [
    ("1f1b", 2, "interleaved1f1b"), ("gpipe", 3, "interleaved1f1b"), ("ZB_H1", 2, "interleaved1f1b"),
    ("1f1b", 1, "1f1b"), ("zbv", 2, "zbv"), ("dualpipev", 2, "dualpipev"), ("i1f1b", 3, "i1f1b"),
])
def test_a_vpp_layout_without_a_schedule_that_fits_runs_interleaved_1f1b(schedule, vpp, expected):
    """The one fallback rule reshard planning (plans/checkpoint/regions.py) and offline resharding
    share: only single-placement schedules move, and only when vpp > 1."""
    assert schedule_for_vpp(schedule, vpp) == expected
