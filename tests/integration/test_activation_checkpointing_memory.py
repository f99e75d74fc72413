"""`--ac full` lowers a rank's peak memory on the small preset (the process's peak RSS).

Each mode trains one step in a fresh process (a CPU process's peak RSS cannot be reset), on one
rank, with a batch whose activations outweigh the weights and optimizer state.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

STEP = """
import json, socket, sys
from actors.training.device_memory import peak_memory_bytes
from actors.training.trainer import Trainer
from plans.config import TrainConfig
from plans.training.model_spec import preset
probe = socket.socket(); probe.bind(("127.0.0.1", 0)); port = probe.getsockname()[1]; probe.close()
config = TrainConfig(model_preset="small", model=preset("small"), steps=1, global_batch=4, seq_len=512,
                     ac=sys.argv[1], store=sys.argv[2], run="m").validate()
trainer = Trainer(config, 0, f"tcp://127.0.0.1:{port}")
before = peak_memory_bytes(trainer.device)
metrics = trainer.train_step()
print(json.dumps({"before_step": before, "peak": metrics.peak_memory_bytes, "loss": metrics.loss}))
trainer.shutdown()
"""


def _peak(ac: str, tmp_path) -> dict:
    done = subprocess.run([sys.executable, "-c", STEP, ac, str(tmp_path / ac)], capture_output=True, text=True,
                          timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_full_activation_checkpointing_lowers_peak_memory(tmp_path):
    none, full = _peak("none", tmp_path), _peak("full", tmp_path)
    assert none["loss"] == full["loss"]
    # What the step added on top of the model and data: activations (and the optimizer's moments,
    # the same in both).
    added_none, added_full = none["peak"] - none["before_step"], full["peak"] - full["before_step"]
    assert added_full < 0.6 * added_none, (added_none >> 20, added_full >> 20)
    print(f"step's added peak RSS: ac none {added_none >> 20} MiB, ac full {added_full >> 20} MiB")
