"""FSDP2 in a Ray Train v2 `TorchTrainer`, checkpointed with `rayshard.checkpoint`: no rayshard
trainer, no rayshard actors, Ray Train runs everything.

    python -m examples.ray_train.train --workers 4 --steps 8 --save-every 4 \\
        --storage /tmp/ray-results --name demo --where /tmp/rayshard-store/demo
    python -m examples.ray_train.train --workers 2 --steps 16 --save-every 4 \\
        --storage /tmp/ray-results --name demo --where /tmp/rayshard-store/demo   # resumes at 8

Each save goes to rayshard's store (`--where`, a run URL or path: `s3://bucket/runs/demo` works
the same) with `rayshard.checkpoint.save`, a collective that returns only once the checkpoint is
committed (create-only manifest, then compare-and-swap LATEST). Only then does the first worker
report to Ray Train a checkpoint of one small file, `rayshard.json`, naming the committed
checkpoint. Ray Train keeps (and uploads to its `storage_path`) that pointer, not a copy of the
tensors: rayshard's checkpoint is already durable, layout-free and verifiable where it is, and a
copy would double the bytes written at each save. A worker killed mid-save therefore leaves
nothing committed in rayshard's run and nothing reported to Ray Train.

A restart with the same `RunConfig(name, storage_path)` (any number of workers) gets Ray Train's
latest reported checkpoint from `ray.train.get_checkpoint()` and loads the rayshard checkpoint it
names into the freshly sharded model and optimizer: every worker reads only its own shards' bytes.

The data is a pure function of (seed, step): a fixed global batch split over the workers, so a
run resumed on another number of workers sees the same batches. Each report carries the losses
of the steps since the previous one (Ray Train keeps the metrics of checkpointed reports).
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import ray.train
import rayshard.checkpoint as ckpt

POINTER = "rayshard.json"  # the one file of a checkpoint reported to Ray Train
GLOBAL_BATCH = 16  # split over the workers: 4 rows each on 4 workers, 8 on 2


class Net(torch.nn.Module):
    """A small MLP; 38 and 10 rows do not divide evenly over 4 workers (uneven FSDP2 shards)."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 38)
        self.down = torch.nn.Linear(38, 10)
        self.norm = torch.nn.LayerNorm(10)
        self.head = torch.nn.Linear(10, 5, bias=False)

    def forward(self, x):
        return self.head(self.norm(self.down(torch.nn.functional.gelu(self.up(x)))))


def batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of `step`: the same on every number of workers (asymmetric on purpose)."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=generator) * torch.linspace(0.5, 2.0, 16) + 0.3
    y = torch.randn(GLOBAL_BATCH, 5, generator=generator) + torch.arange(5) * 0.1
    return x, y


def build(world: int, lr: float):
    torch.manual_seed(0)  # the same initial weights on every worker, before sharding
    model = Net()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    for layer in (model.up, model.down):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.05)


def train_step(model, optimizer, seed: int, step: int, rank: int, world: int) -> float:
    x, y = batch(seed, step)
    rows = GLOBAL_BATCH // world
    loss = torch.nn.functional.mse_loss(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    value = loss.detach().clone()
    dist.all_reduce(value)
    return float(value) / world


def state_of(model, optimizer, step: int) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optim": optim_state, "train": {"step": step}}


def resume(model, optimizer) -> int:
    """Load Ray Train's latest reported checkpoint, if any; returns the steps it had completed."""
    reported = ray.train.get_checkpoint()
    if reported is None:
        return 0
    with reported.as_directory() as directory:
        pointer = json.loads(Path(directory, POINTER).read_text())
    state = state_of(model, optimizer, 0)
    ckpt.load(state, pointer["checkpoint"])  # any number of workers saved it
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return state["train"]["step"]


def report(step: int, losses: dict[int, float], committed) -> None:
    """Every worker reports (Ray Train's barrier); the first one attaches the pointer."""
    metrics = {"step": step, "loss": losses[step], "losses": [[s, loss] for s, loss in sorted(losses.items())]}
    if ray.train.get_context().get_world_rank() != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, POINTER).write_text(json.dumps({"checkpoint": committed.url, "run": committed.run,
                                                        "step": committed.step}))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(directory))


def train_func(config: dict) -> None:
    """The per-worker loop. config: where (rayshard run URL), steps, save_every, seed, lr."""
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()  # Ray Train set up the process group
    model, optimizer = build(world, config.get("lr", 2e-2))
    losses: dict[int, float] = {}
    for step in range(resume(model, optimizer) + 1, config["steps"] + 1):
        losses[step] = train_step(model, optimizer, config.get("seed", 0), step, rank, world)
        if step % config["save_every"] == 0 or step == config["steps"]:
            # Returns once committed on every worker; raises on every worker if any failed.
            committed = ckpt.save(state_of(model, optimizer, step), config["where"], step=step)
            report(step, losses, committed)
            losses = {}


def trainer(config: dict, workers: int, storage: str, name: str, resources_per_worker: dict | None = None):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        train_func, train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False, resources_per_worker=resources_per_worker or {"CPU": 0.25}),
        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(max_failures=0)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--storage", required=True, help="Ray Train's storage_path (absolute path or URI)")
    parser.add_argument("--name", default="rayshard-ray-train")
    parser.add_argument("--where", required=True, help="rayshard run URL or absolute path, e.g. s3://bucket/runs/demo")
    parser.add_argument("--address", default=None, help="Ray cluster to join ('local' starts one; default: Ray's own choice)")
    args = parser.parse_args()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray

    ray.init(address=args.address)
    config = {"where": args.where, "steps": args.steps, "save_every": args.save_every}
    result = trainer(config, args.workers, args.storage, args.name).fit()
    print(f"step {result.metrics['step']}: loss {result.metrics['loss']:.6f}; Ray Train checkpoint {result.checkpoint.path}")


if __name__ == "__main__":
    main()
