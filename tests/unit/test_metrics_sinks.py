"""Step metrics reach metrics.jsonl and TensorBoard event files that TensorBoard reads back; W&B
asked for without the package fails before anything starts."""
from __future__ import annotations

import importlib.util
import os
import uuid

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rayshard.cluster.run.metrics_sinks import check_sinks, open_sinks
from rayshard.cluster.catalog.store import Store
from rayshard.plans.config import MetricsConfig, TrainConfig
from rayshard.plans.errors import ConfigError


def test_jsonl_and_tensorboard_hold_every_step(tmp_path):
    config = TrainConfig(store=str(tmp_path), run="r", metrics=MetricsConfig(tensorboard=True))
    store = Store(str(tmp_path))
    sinks = open_sinks(config, store, 0)
    for step in (1, 2, 3):
        record = {"step": step, "loss": 5.0 - step / 10, "mfu": None, "tokens_per_s": 1000.0 * step}
        for sink in sinks:
            sink.append(record)
    for sink in sinks:
        sink.flush()
    lines = store.read_text("r/metrics.jsonl").strip().splitlines()
    assert len(lines) == 3 and '"step": 3' in lines[-1]
    events = EventAccumulator(str(tmp_path / "r" / "tensorboard"))
    events.Reload()
    assert "train/mfu" not in events.Tags()["scalars"]  # n/a is not a zero
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("train/loss")] == [(1, 4.9), (2, 4.8), (3, 4.7)]
    assert [e.value for e in events.Scalars("train/tokens_per_s")] == [1000.0, 2000.0, 3000.0]


def _losses(directory) -> list[tuple[int, float]]:
    events = EventAccumulator(str(directory))
    events.Reload()
    return [(e.step, round(e.value, 4)) for e in events.Scalars("train/loss")]


def _log_steps(sinks, steps, loss) -> None:
    for step in steps:
        for sink in sinks:
            sink.append({"step": step, "loss": loss(step)})
    for sink in sinks:
        sink.close()


def test_an_object_store_gets_the_event_files_under_the_run(tmp_path):
    url = f"memory://tensorboard-{uuid.uuid4().hex}/runs"
    store = Store(url)
    sinks = open_sinks(TrainConfig(store=url, run="r", metrics=MetricsConfig(tensorboard=True)), store, 0)
    assert sinks[1].where == f"{url}/r/tensorboard"
    _log_steps(sinks, (1, 2), lambda step: step / 10)
    store.fs.get(f"{store.root}/r/tensorboard/", str(tmp_path / "copy") + "/", recursive=True)
    assert _losses(tmp_path / "copy") == [(1, 0.1), (2, 0.2)]
    assert not os.path.exists(sinks[1].directory)  # the local staging folder went with the run


def test_a_resumed_run_hides_the_abandoned_steps_from_tensorboard(tmp_path):
    config = TrainConfig(store=str(tmp_path), run="r", metrics=MetricsConfig(tensorboard=True))
    store = Store(str(tmp_path))
    _log_steps(open_sinks(config, store, 0), range(1, 6), lambda step: step)  # steps 4 and 5 are abandoned
    _log_steps(open_sinks(config, store, 3), (4, 5), lambda step: -step)  # resumed at the step-3 checkpoint
    assert _losses(tmp_path / "r" / "tensorboard") == [(1, 1), (2, 2), (3, 3), (4, -4), (5, -5)]


def test_a_resume_keeps_the_earlier_lines_and_drops_the_abandoned_ones(tmp_path):
    store = Store(str(tmp_path))
    store.write_text("r/metrics.jsonl", "\n".join(f'{{"step": {s}}}' for s in range(1, 6)) + "\n")
    log = open_sinks(TrainConfig(store=str(tmp_path), run="r"), store, 3)[0]
    assert [line for line in log.lines] == ['{"step": 1}', '{"step": 2}', '{"step": 3}']


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_the_package_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"wandb_project='p': needs the wandb package.*Fix: pip install wandb"):
        check_sinks(TrainConfig(metrics=MetricsConfig(wandb_project="p")))
