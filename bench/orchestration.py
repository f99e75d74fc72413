"""Ray actors vs torch.multiprocessing.spawn: what does Ray orchestration cost per step?

Runs the same model, layout, batch and steps through `rayshard.cluster.run.rank_group.RankGroup` (one Ray
actor per rank, one RPC per step) and through `torch.multiprocessing.spawn` (the same
`rayshard.actors.training.trainer.Trainer`, no Ray), alternating several times, and prints the median step time of
each and their ratio. Goal: Ray adds at most 5%.

    .venv/bin/python bench/orchestration.py [--model tiny|small] [--dp 2 --tp 2] [--steps 20] [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.multiprocessing as mp  # noqa: E402

from rayshard.plans.config import DataConfig, ModelChoice, TrainConfig  # noqa: E402
from rayshard.plans.layout.parallel_layout import ParallelLayout  # noqa: E402

WARMUP_STEPS = 3


def _spawned_rank(rank, config, port, queue):
    from rayshard.actors.training.trainer import Trainer

    trainer = Trainer(config, rank, f"tcp://127.0.0.1:{port}")
    times = []
    for _ in range(config.steps):
        tick = time.perf_counter()
        trainer.train_step()  # ends in an all-reduce, so every rank has finished the step
        times.append(time.perf_counter() - tick)
    if rank == 0:
        queue.put(times)
    trainer.shutdown()


def step_times_multiprocessing(config: TrainConfig) -> list[float]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_spawned_rank, args=(config, port, queue), nprocs=config.layout.world_size)
    return queue.get()[WARMUP_STEPS:]


def step_times_ray(config: TrainConfig) -> list[float]:
    from rayshard.cluster.run.rank_group import RankGroup

    group = RankGroup(config)
    try:
        times = []
        for _ in range(config.steps):
            tick = time.perf_counter()
            group.call("train_step")
            times.append(time.perf_counter() - tick)
        return times[WARMUP_STEPS:]
    finally:
        group.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    config = TrainConfig(model=ModelChoice.named(args.model), layout=ParallelLayout(dp=args.dp, fsdp=args.fsdp, tp=args.tp),
                         steps=args.steps + WARMUP_STEPS, global_batch=args.global_batch, seq_len=args.seq_len,
                         data=DataConfig(max_bytes=2_000_000)).validate()
    import ray

    ray.init(num_gpus=0, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    ray_medians, mp_medians = [], []
    for repeat in range(args.repeats):
        ray_medians.append(statistics.median(step_times_ray(config)))
        mp_medians.append(statistics.median(step_times_multiprocessing(config)))
        print(f"repeat {repeat + 1}: ray {ray_medians[-1] * 1e3:.1f} ms/step, "
              f"multiprocessing {mp_medians[-1] * 1e3:.1f} ms/step", flush=True)
    ray_ms, mp_ms = statistics.median(ray_medians) * 1e3, statistics.median(mp_medians) * 1e3
    print(f"\nmodel {args.model}, layout {config.layout.describe()}, batch {args.global_batch}x{args.seq_len}, "
          f"{args.steps} timed steps x {args.repeats} repeats (medians)")
    print(f"  Ray actors:              {ray_ms:8.1f} ms/step")
    print(f"  torch.multiprocessing:   {mp_ms:8.1f} ms/step")
    print(f"  ratio ray / mp:          {ray_ms / mp_ms:8.3f}   (goal <= 1.05)")
    ray.shutdown()


if __name__ == "__main__":
    main()
