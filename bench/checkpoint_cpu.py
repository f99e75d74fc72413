"""CPU seconds per load: `rayshard.checkpoint.load`, the trainer's load and DCP's load on the same
state, per rank, as a figure that a shared machine's scheduling does not swamp.

bench/checkpoint.py times the slowest rank's wall clock, which on a machine with fewer cores than
ranks (4 ranks, 2 shared cores) is mostly waiting to be scheduled: a process gets a quarter of a
core at load average 8, and every exchange waits for the last rank to run. Here each rank measures
its own `time.process_time()` (every thread of the process) around each load, between barriers:
the work a load does, not when it got to do it. Four ranks on layout A (dp2 x tp2) train the small
preset one step and save through the trainer's path, the API and DCP; then four fresh ranks on
layout A or B (fsdp4) load each, N times in turn. The API and DCP load into one state dict made
once by `get_state_dict` (its cost, and `set_state_dict`'s, are bench/checkpoint.py's `sd` figure,
paid by both alike); the trainer's load fills the model and optimizer directly.

    .venv/bin/python bench/checkpoint_cpu.py [--layout A|B] [--model small] [--repeats 7] [--root /tmp/rayshard-bench-cpu]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench.checkpoint as bench  # noqa: E402
from rayshard.plans.config import DataConfig, ModelChoice, TrainConfig  # noqa: E402

METHODS = ("api", "rayshard", "dcp")


def _save(rank, config, port, root, repeats, queue):
    from rayshard.actors.training.trainer import Trainer

    trainer = Trainer(config, rank, f"tcp://127.0.0.1:{port}")
    trainer.train_step()
    bench._api_save(trainer, root, 0)
    bench._our_save(trainer, f"{root}/rayshard-0")
    bench._dcp_save(trainer, f"{root}/dcp-0")
    queue.put((rank, {}))
    trainer.shutdown()


def _load(rank, config, port, root, repeats, queue):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import rayshard.checkpoint as ckpt
    from rayshard.actors.training.trainer import Trainer

    trainer = Trainer(config, rank, f"tcp://127.0.0.1:{port}")
    bench._our_load(trainer, f"{root}/rayshard-0")  # creates the AdamW state every method then fills
    state = bench._dcp_state(trainer)
    loads = {"api": lambda: ckpt.load(state, f"{root}/api-store/api@0"),
             "rayshard": lambda: bench._our_load(trainer, f"{root}/rayshard-0"),
             "dcp": lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(f"{root}/dcp-0"))}
    for load in loads.values():  # untimed: first-call costs (the API's gloo group, DCP's caches)
        load()
    seconds = {method: [] for method in METHODS}
    for _ in range(repeats):
        for method in METHODS:
            dist.barrier()
            started = time.process_time()
            loads[method]()
            seconds[method].append(time.process_time() - started)
    queue.put((rank, seconds))
    trainer.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", choices=("A", "B"), default="B", help="the loading layout: A dp2 x tp2, B fsdp4")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--model", default="small", help="model preset (small, medium)")
    parser.add_argument("--root", default="/tmp/rayshard-bench-cpu")
    args = parser.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    os.makedirs(args.root)
    common = dict(model=ModelChoice.named(args.model), steps=1, global_batch=8, seq_len=64,
                  data=DataConfig(max_bytes=2_000_000))
    bench._spawn(_save, TrainConfig(layout=bench.LAYOUT_A, **common).validate(), args.root, args.repeats)
    layout = bench.LAYOUT_A if args.layout == "A" else bench.LAYOUT_B
    results = bench._spawn(_load, TrainConfig(layout=layout, **common).validate(), args.root, args.repeats)
    print(f"CPU seconds per load on layout {layout.describe()} of layout A's checkpoints, median of {args.repeats} "
          "per rank (process_time, all threads):")
    means = {}
    for method in METHODS:
        per_rank = [statistics.median(seconds[method]) for _, seconds in results]
        means[method] = statistics.mean(per_rank)
        print(f"  {method:<9}" + " ".join(f"{value:.3f}" for value in per_rank) + f"   mean {means[method]:.3f}")
    print(f"  DCP / API {means['dcp'] / means['api']:.2f}, DCP / trainer path {means['dcp'] / means['rayshard']:.2f}, "
          f"API / trainer path {means['api'] / means['rayshard']:.2f}")


if __name__ == "__main__":
    main()
