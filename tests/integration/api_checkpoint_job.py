"""A user's own training loop checkpointing through `rayshard.checkpoint`: no Ray, no rayshard
trainer. Run by the tests under torchrun (`python -m torch.distributed.run ... -m
tests.integration.api_checkpoint_job SPEC_JSON`) or as forked gloo ranks (`forked_job`).

The model is small and every dim is uneven for its mesh (22 rows over tp2 x fsdp2 is 6+5 per tp
half; 9 rows over fsdp2 is 5+4), so FSDP2 x TP gives `_StridedShard` placements and uneven shards.
A mesh dim named "dp_shard" is FSDP2's, one named "tp" tensor parallelism; with tp alone, the
layers TP does not touch stay plain tensors (copied on every rank). Data: a fixed global batch per
step from (seed, step), asymmetric, split over the data-parallel ranks.

SPEC keys: mesh [[name, size], ...]; where (run URL); steps; save_at [steps]; async_at [steps]
(saved with async_save, the next step changing the tensors before the write ends); async_optimizer
(those async saves are given the optimizer: its tensors are copied beside the next forward and
backward, its step waiting for the copy); hold_copy_s (that copy starts so many seconds late;
the report's "deferred" counts the pieces it copies); load (what to
resume from); resave (a run to save into right after loading, at the loaded step); out (JSON
file rank 0 writes: losses per step, loaded step, refs); fail_rank / fail_at (that rank raises
inside its state dict's flattening at that save); kill_at (rank 1 kills itself -9 during the save
at that step, after the first rank planned it).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import rayshard.checkpoint as ckpt

GLOBAL_BATCH = 8


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(12, 22)
        self.down = torch.nn.Linear(22, 9)
        self.norm = torch.nn.LayerNorm(9)
        self.head = torch.nn.Linear(9, 7, bias=False)

    def forward(self, x):
        return self.head(self.norm(self.down(torch.nn.functional.gelu(self.up(x)))))


def build(mesh_spec):
    torch.manual_seed(0)
    model = Net()
    names = [name for name, _ in mesh_spec]
    mesh = init_device_mesh("cpu", tuple(size for _, size in mesh_spec), mesh_dim_names=tuple(names)) if mesh_spec else None
    if "tp" in names:
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if "dp_shard" in names:
        fully_shard(model, mesh=mesh["dp_shard"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.05)
    dp = dict(mesh_spec).get("dp_shard", 1)
    dp_rank = mesh["dp_shard"].get_local_rank() if "dp_shard" in names else 0
    return model, optimizer, dp, dp_rank


def batch(step: int):
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 12, generator=generator) * torch.linspace(0.5, 2.0, 12) + 0.3
    y = torch.randn(GLOBAL_BATCH, 7, generator=generator) + torch.arange(7) * 0.1
    return x, y


def train_step(model, optimizer, step: int, dp: int, dp_rank: int) -> float:
    x, y = batch(step)
    rows = GLOBAL_BATCH // dp
    x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    value = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def state_of(model, optimizer, step: int) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "train": {"step": step, "note": f"after step {step}"}}


class Fail(Exception):
    pass


class _Poisoned(dict):
    """A state dict whose flattening fails on this rank only (a rank's bad input)."""

    def items(self):
        raise Fail("this rank's state dict could not be read (a test's injected failure)")


def run(spec: dict) -> dict:
    rank = dist.get_rank() if dist.is_initialized() else 0
    model, optimizer, dp, dp_rank = build(spec.get("mesh", []))
    report = {"losses": {}, "refs": []}
    step = 0
    if spec.get("load"):
        state = state_of(model, optimizer, -1)
        loaded = ckpt.load(state, spec["load"])
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = state["train"]["step"]
        report.update(loaded_step=loaded.step, loaded_metadata=loaded.metadata, note=state["train"]["note"])
        if spec.get("resave"):
            report["resaved"] = ckpt.save(state_of(model, optimizer, step), spec["resave"], step=step).url
    pending = None
    if spec.get("hold_copy_s"):  # the deferred copy starts late: the next step must wait for it
        from rayshard.actors.checkpoint.deferred_copy import DeferredCopy

        real_run = DeferredCopy.run

        def late_run(copy, staging, into):
            report["deferred"] = len(copy.indices)
            time.sleep(spec["hold_copy_s"])
            return real_run(copy, staging, into)

        DeferredCopy.run = late_run
    for step in range(step + 1, spec["steps"] + 1):
        report["losses"][step] = train_step(model, optimizer, step, dp, dp_rank)
        if step in spec.get("save_at", ()) or step in spec.get("async_at", ()):
            state = state_of(model, optimizer, step)
            if spec.get("fail_at") == step and rank == spec.get("fail_rank"):
                state = _Poisoned(state)
            if spec.get("kill_at") == step and rank == 1:
                _die_while_saving()
            try:
                if step in spec.get("async_at", ()):
                    pending = ckpt.async_save(state, spec["where"], step=step, metadata={"by": "job"},
                                              optimizer=optimizer if spec.get("async_optimizer") else None)
                else:
                    report["refs"].append(ckpt.save(state, spec["where"], step=step, metadata={"by": "job"}).url)
            except Exception as error:  # noqa: BLE001 (reported to the test as the line a user sees)
                report["error"] = f"{type(error).__name__}: {error}"
                break
        if pending is not None and step not in spec.get("async_at", ()):
            report["refs"].append(pending.result().url)  # one step after the async save: its tensors changed meanwhile
            pending = None
    if pending is not None:
        report["refs"].append(pending.result().url)
    return report


def _die_while_saving() -> None:
    """Rank 1 writes its share, then dies before the chunks are gathered: a real mid-save death."""
    import rayshard.cluster.api.checkpoint as api

    real = api._write_share

    def write_then_die(share, snapshot):
        written = real(share, snapshot)
        os.kill(os.getpid(), signal.SIGKILL)
        return written

    api._write_share = write_then_die


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    try:
        report = run(spec)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0 and spec.get("out"):
        with open(spec["out"], "w") as handle:
            json.dump(report, handle)
    return 0


def forked_job(rank: int, init_method: str, world_size: int, results, spec: dict) -> None:
    """tests/forked_ranks.py's entry: the same job in a forked gloo rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        results[rank] = run(spec)
    except Exception as error:  # noqa: BLE001 (the test reads every rank's line)
        results[rank] = {"exception": f"{type(error).__name__}: {error}"}
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
