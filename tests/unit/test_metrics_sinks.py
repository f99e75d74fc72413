"""Step metrics reach metrics.jsonl and TensorBoard event files that TensorBoard reads back; W&B
asked for without the package fails before anything starts."""
from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import uuid

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rayshard.cluster.run.metrics_sinks import check_sinks, open_sinks, read_metrics
from rayshard.plans.training.metrics_timeline import current_timeline
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


def test_a_resume_appends_and_reading_back_drops_the_abandoned_steps(tmp_path):
    store = Store(str(tmp_path))
    earlier = "\n".join(f'{{"step": {s}, "loss": {s}}}' for s in range(1, 6)) + "\n"
    store.write_text("r/metrics.jsonl", earlier)
    log = open_sinks(TrainConfig(store=str(tmp_path), run="r"), store, 3)[0]
    log.append({"step": 4, "loss": -4})  # resumed at the step-3 checkpoint; crashed after step 4
    log.close()
    assert store.read_text("r/metrics.jsonl").startswith(earlier)  # appended, never rewritten
    assert [(r["step"], r["loss"]) for r in read_metrics(store, "r")] == [(1, 1), (2, 2), (3, 3), (4, -4)]


def test_current_timeline_keeps_each_step_once_across_attempts():
    records = [{"step": s, "a": 1} for s in range(1, 8)] + [{"step": s, "a": 2} for s in (5, 6)] \
        + [{"step": s, "a": 3} for s in (3, 4, 5)] + [{"step": "x"}, {"loss": 1}]
    assert [(r["step"], r["a"]) for r in current_timeline(records)] == [(1, 1), (2, 1), (3, 3), (4, 3), (5, 3)]


def _append_lines(url: str, writer: int, count: int) -> None:
    store = Store(url)
    log = open_sinks(TrainConfig(store=url, run="r"), store, 0)[0]
    for step in range(count):
        log.append({"step": step, "writer": writer})
        log.flush()


@pytest.mark.parametrize("where", [pytest.param("local", marks=pytest.mark.slow), "s3"])  # local: -m slow (decision 113)
def test_two_processes_appending_at_once_lose_no_line(where, tmp_path, request):
    """Two trainers' metrics logs on one run (the case the run's writer lease is there to
    prevent): whatever the interleaving, every line of both survives."""
    url = str(tmp_path) if where == "local" else request.getfixturevalue("s3_store")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_append_lines, args=(url, writer, 15)) for writer in (1, 2)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(120)
        assert process.exitcode == 0
    lines = [json.loads(line) for line in Store(url).read_text("r/metrics.jsonl").splitlines()]
    for writer in (1, 2):
        assert [line["step"] for line in lines if line["writer"] == writer] == list(range(15))


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_the_package_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"wandb_project='p': needs the wandb package.*Fix: pip install wandb"):
        check_sinks(TrainConfig(metrics=MetricsConfig(wandb_project="p")))
