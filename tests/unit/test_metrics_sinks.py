"""Step metrics reach metrics.jsonl and TensorBoard event files that TensorBoard reads back; W&B
asked for without the package fails before anything starts."""
from __future__ import annotations

import importlib.util

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cluster.run.metrics_sinks import check_sinks, open_sinks
from cluster.storage.store import Store
from plans.config import TrainConfig
from plans.errors import ConfigError


def test_jsonl_and_tensorboard_hold_every_step(tmp_path):
    config = TrainConfig(store=str(tmp_path), run="r", tensorboard=True)
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


def test_a_resume_keeps_the_earlier_lines_and_drops_the_abandoned_ones(tmp_path):
    store = Store(str(tmp_path))
    store.write_text("r/metrics.jsonl", "\n".join(f'{{"step": {s}}}' for s in range(1, 6)) + "\n")
    log = open_sinks(TrainConfig(store=str(tmp_path), run="r"), store, 3)[0]
    assert [line for line in log.lines] == ['{"step": 1}', '{"step": 2}', '{"step": 3}']


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_without_the_package_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"wandb_project='p': needs the wandb package.*Fix: pip install wandb"):
        check_sinks(TrainConfig(wandb_project="p"))
