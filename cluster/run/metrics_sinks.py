"""Where each step's metrics go: metrics.jsonl in the run directory always, TensorBoard event
files with --tensorboard, Weights & Biases with --wandb-project (when the package is installed).

TensorBoard's writer appends to local files; on an object store the events are written to a
local temporary folder and copied to RUN/tensorboard/ in the store at every flush (each
checkpoint and the end of the run), so the run's directory holds them either way. A resumed run
hides the abandoned steps past its checkpoint from TensorBoard (`purge_step`), as reading
metrics.jsonl back does (`read_metrics`).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import tempfile

from torch.utils.tensorboard import SummaryWriter

from rayshard.cluster.run.json_lines import json_records
from rayshard.storage.appends import append_bytes
from rayshard.plans.training.metrics_timeline import current_timeline
from rayshard.cluster.catalog.store import Store
from rayshard.plans.config import TrainConfig
from rayshard.plans.errors import ConfigError

# The numbers a step record carries that are worth a curve.
SCALARS = ("loss", "grad_norm", "lr", "tokens_per_s", "tokens_per_s_per_rank", "tflops_per_rank", "mfu",
           "peak_memory_gib", "step_s", "aux_loss", "expert_load_imbalance",
           "rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy")  # the last four: --objective dpo


class MetricsLog:
    """metrics.jsonl in the run directory: one line per step, only ever appended (at each
    checkpoint and at the end), never rewritten, so a second process writing the same run cannot
    erase this one's lines. A resumed attempt appends its steps again from the checkpoint on;
    `read_metrics` tells the current timeline (plans/training/metrics_timeline.py)."""

    def __init__(self, store: Store, run: str, start_step: int):
        self.store, self.relative = store, f"{run}/metrics.jsonl"
        self.pending: list[str] = []

    def append(self, record: dict) -> None:
        self.pending.append(json.dumps(record, sort_keys=True))

    def flush(self) -> None:
        if not self.pending:
            return
        path = f"{self.store.root}/{self.relative}"
        self.store.backend.make_directory(path.rsplit("/", 1)[0])
        append_bytes(self.store.backend, path, ("\n".join(self.pending) + "\n").encode())
        self.pending = []

    def close(self) -> None:
        self.flush()

    def discard(self) -> None:
        """Forget the lines not yet written: this trainer lost the run to another."""
        self.pending = []

    @property
    def where(self) -> str:
        return f"{self.store.url.rstrip('/')}/{self.relative}"


def read_metrics(store: Store, run: str) -> list[dict] | None:
    """The run's step records on its current timeline, each step once (None: no metrics.jsonl)."""
    text = store.read_text(f"{run}/metrics.jsonl")
    if text is None:
        return None
    return current_timeline(json_records(text, f"{store.url}/{run}/metrics.jsonl"))


class TensorBoardSink:
    def __init__(self, store: Store, run: str, start_step: int = 0):
        self.store, self.run = store, run
        local = store.backend.local_paths
        self.directory = (os.path.join(store.root, run, "tensorboard") if local
                          else tempfile.mkdtemp(prefix=f"rayshard-tensorboard-{run}-"))
        self.remote = None if local else f"{store.root}/{run}/tensorboard"
        # The first step this run logs is start_step + 1: events of an earlier attempt at or past it
        # belong to the abandoned timeline (purge_step=None on a fresh run: nothing to hide).
        self.writer = SummaryWriter(self.directory, purge_step=start_step + 1 if start_step else None)

    def append(self, record: dict) -> None:
        for key in SCALARS:
            if record.get(key) is not None:
                self.writer.add_scalar(f"train/{key}", record[key], record["step"])
        for layer, counts in (record.get("expert_tokens") or {}).items():  # an MoE model's routing, per layer
            self.writer.add_scalars(f"experts/layer{layer}", {f"expert{e}": n for e, n in enumerate(counts)}, record["step"])

    def flush(self) -> None:
        self.writer.flush()
        if self.remote is not None:
            self.store.fs.put(self.directory + "/", self.remote, recursive=True)

    def close(self) -> None:
        self.writer.close()
        self.flush()  # the last upload, after close wrote everything
        if self.remote is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    @property
    def where(self) -> str:
        return self.remote and f"{self.store.url.rstrip('/')}/{self.run}/tensorboard" or self.directory


class WandbSink:
    def __init__(self, config: TrainConfig):
        self.wandb = importlib.import_module("wandb")
        self.session = self.wandb.init(project=config.metrics.wandb_project, name=config.run,
                                       config=json.loads(json.dumps(config.to_dict(), default=str)), resume="allow")

    def append(self, record: dict) -> None:
        self.session.log({key: record[key] for key in SCALARS if record.get(key) is not None}, step=record["step"])

    def flush(self) -> None:
        pass  # wandb uploads in its own process

    def close(self) -> None:
        self.session.finish()

    @property
    def where(self) -> str:
        return f"W&B project {self.session.project}, run {self.session.name}"


def check_sinks(config: TrainConfig) -> None:
    """Before any actor starts: a sink asked for must be available."""
    if config.metrics.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb_project", config.metrics.wandb_project,
                          "needs the wandb package, which is not installed",
                          "pip install wandb (and log in), or drop --wandb-project")


def open_sinks(config: TrainConfig, store: Store, start_step: int) -> list:
    """metrics.jsonl first (it is what `ckpt plot-resume` and the tests read), then the others."""
    sinks: list = [MetricsLog(store, config.run, start_step)]
    if config.metrics.tensorboard:
        sinks.append(TensorBoardSink(store, config.run, start_step))
    if config.metrics.wandb_project:
        sinks.append(WandbSink(config))
    return sinks
