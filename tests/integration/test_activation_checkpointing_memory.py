"""`--ac full` lowers a rank's peak memory on the small preset (the process's peak RSS).

Each mode trains one step in a process of its own (a CPU process's peak RSS cannot be reset),
forked from the test, on one rank, with a batch whose activations outweigh the weights and
optimizer state. A forked child's peak starts at its resident set when it was forked, so the step's
own addition is its peak after the step less its peak before it.
"""
from __future__ import annotations

from pathlib import Path

from tests.forked_ranks import run_ranks


def _one_step(rank: int, init_method: str, world_size: int, results, ac: str, store: str) -> None:
    from actors.training.device_memory import peak_memory_bytes
    from actors.training.trainer import Trainer
    from plans.config import TrainConfig
    from plans.training.model_spec import preset

    config = TrainConfig(model_preset="small", model=preset("small"), steps=1, global_batch=4, seq_len=512,
                         ac=ac, store=store, run="m").validate()
    trainer = Trainer(config, rank, init_method)
    try:
        before = peak_memory_bytes(trainer.device)
        metrics = trainer.train_step()
        results[rank] = {"before_step": before, "peak": metrics.peak_memory_bytes, "loss": metrics.loss}
    finally:
        trainer.shutdown()


def _peak(ac: str, tmp_path: Path) -> dict:
    return run_ranks(_one_step, 1, ac, str(tmp_path / ac))[0]


def test_full_activation_checkpointing_lowers_peak_memory(tmp_path):
    none, full = _peak("none", tmp_path), _peak("full", tmp_path)
    assert none["loss"] == full["loss"]
    # What the step added on top of the model and data: activations (and the optimizer's moments,
    # the same in both).
    added_none, added_full = none["peak"] - none["before_step"], full["peak"] - full["before_step"]
    assert added_full < 0.6 * added_none, (added_none >> 20, added_full >> 20)
    print(f"step's added peak RSS: ac none {added_none >> 20} MiB, ac full {added_full >> 20} MiB")
