"""Expert parallelism: step time on ep2 against the same MoE model with replicated experts on dp2,
and the bytes its all-to-alls carry against the analytic figure.

Two ranks (torch.multiprocessing + gloo, one thread each: the same `Trainer` the Ray actors run).
- ep2: `fsdp2(ep2)`: each rank holds half the experts whole; the other weights FSDP2-sharded.
  Tokens go to their experts' rank and back by all-to-all (two per MoE layer in the forward, two
  in the backward).
- dp2: every rank holds every expert (HSDP with one shard: weights replicated, gradients
  all-reduced); no all-to-all.
The two alternate, `--repeat` times each, and the median step time (after warm-up) of each is
reported; ep2/dp2 is the report's figure (no goal: on two CPU cores the all-to-all is memory
traffic, the win ep brings on a cluster is memory per rank and the all-reduce it avoids).

All-to-all bytes: what the forward's token exchanges carried over the step, every rank and MoE
layer, as the trainer counts it (`StepMetrics.all_to_all_bytes`), against global tokens x k x dim
x bytes per element x 2 (dispatch and return) x MoE layers. Dropless routing sends each of a
token's k slots exactly once, so the ratio is 1.000; the part sent to the other rank is printed
too (1 - 1/ep of it under balanced routing).

    .venv/bin/python bench/moe.py [--model moe-small] [--seq-len 128] [--batch 8] [--steps 6] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.multiprocessing as mp  # noqa: E402

from rayshard.plans.config import DataConfig, ModelChoice, OptimizerConfig, TrainConfig  # noqa: E402
from rayshard.plans.layout.parallel_layout import ParallelLayout  # noqa: E402
from rayshard.plans.training.model_spec import preset  # noqa: E402

WARMUP = 2


def _rank(rank, config, port, queue):
    from rayshard.actors.training.trainer import Trainer

    trainer = Trainer(config, rank, f"tcp://127.0.0.1:{port}")
    times, metrics = [], None
    for _ in range(config.steps):
        tick = time.perf_counter()
        metrics = trainer.train_step()  # ends in an all-reduce: every rank has finished the step
        times.append(time.perf_counter() - tick)
    if rank == 0:
        queue.put((times[WARMUP:], metrics.all_to_all_bytes, metrics.all_to_all_peer_bytes))
    trainer.shutdown()


def run(config: TrainConfig) -> tuple[float, int, int]:
    """Median step seconds, and the last step's all-to-all bytes (total, to other ranks)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(config, port, queue), nprocs=config.layout.world_size)
    times, exchanged, to_peers = queue.get()
    return statistics.median(times), exchanged, to_peers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="moe-small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    model = preset(args.model)
    base = TrainConfig(model=ModelChoice(args.model, model), steps=args.steps + WARMUP, global_batch=args.batch,
                       seq_len=args.seq_len, seed=7, optimizer=OptimizerConfig(lr=1e-3, warmup_steps=1),
                       data=DataConfig(source="stdlib", max_bytes=2_000_000), store="/tmp/rayshard-bench-moe", run="moe")
    layouts = {"ep2": ParallelLayout(fsdp=2, ep=2), "dp2": ParallelLayout(dp=2)}
    seconds = {name: [] for name in layouts}
    exchanged = {}
    for attempt in range(args.repeat):
        for name, layout in layouts.items():
            step, total, to_peers = run(replace(base, layout=layout).validate())
            seconds[name].append(step)
            exchanged[name] = (total, to_peers)
            print(f"  [{attempt + 1}/{args.repeat}] {name}: {step * 1e3:.1f} ms/step", flush=True)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    tokens = args.batch * args.seq_len
    analytic = tokens * model.experts_per_token * model.dim * 4 * 2 * len(model.moe_layers)
    total, to_peers = exchanged["ep2"]
    print(f"{args.model}: {model.n_experts} experts, top-{model.experts_per_token}, {len(model.moe_layers)} MoE layers; "
          f"{tokens} tokens/step, fp32")
    print(f"  step time   ep2 {medians['ep2'] * 1e3:.1f} ms, dp2 (replicated experts) {medians['dp2'] * 1e3:.1f} ms: "
          f"ep2/dp2 = {medians['ep2'] / medians['dp2']:.2f} (report; medians of {args.repeat})")
    print(f"  all-to-all  {total / 2**20:.2f} MiB/step forward (dispatch + return) vs analytic tokens x k x dim x 4 B "
          f"x 2 x layers = {analytic / 2**20:.2f} MiB: ratio {total / analytic:.3f}; "
          f"{to_peers / max(1, total):.1%} of it to the other rank (balanced routing: 50%)")


if __name__ == "__main__":
    main()
