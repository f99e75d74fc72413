"""Pipeline execution: our interpreter against torch.distributed.pipelining, and the simulator
against the clock.

    .venv/bin/python bench/pipeline.py [--model small] [--pp 4] [--microbatches 8]
                                       [--global-batch 16] [--seq-len 128] [--steps 8]

One process per rank (torch.multiprocessing, gloo on CPU, one thread each). Every rank builds
its stage once (`rayshard.actors.training.trainer.Trainer`) and three executors drive the same stage modules,
optimizer and batches, taking turns step by step so that drifting machine load hits each alike:

- ours 1F1B: the trainer's interpreter replaying the lowered 1F1B plan;
- torch 1F1B: torch.distributed.pipelining's Schedule1F1B over the same stage module, with the
  same gradient clipping, optimizer step and loss all-reduce around it;
- ours ZB-H1: the interpreter replaying the lowered ZB-H1 plan (same stage cut).

It prints the median step time of each (a step ends with an all-reduce, so every rank has
finished it) after one warm-up round, with the goals: ours 1F1B at least as fast as torch's,
ZB-H1 at least 1.10x faster than 1F1B, and the simulator, replaying each of our plans with the
per-action times this run measured, within 15% of the measured plan time. CPU seconds per step
show whether the ranks had a core each: with fewer cores than ranks, one rank's bubble is
another's CPU time and no schedule can beat total CPU time / cores.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from rayshard.plans.config import DataConfig, ModelChoice, PipelineConfig, TrainConfig  # noqa: E402
from rayshard.plans.layout.parallel_layout import ParallelLayout  # noqa: E402
from rayshard.plans.pipeline.plan import build_pipeline_plan  # noqa: E402

VARIANTS = ("ours-1f1b", "torch-1f1b", "ours-zbh1")
WARMUP_ROUNDS = 1


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class _TorchSchedule1F1B:
    """torch's Schedule1F1B around the trainer's own stage module, optimizer and batches."""

    def __init__(self, trainer):
        import torch.nn.functional as F
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.trainer = trainer
        pp_rank, pp = trainer.coords.pp, trainer.layout.pp
        self.module = trainer.model.modules[pp_rank]
        stage = PipelineStage(self.module, pp_rank, pp, trainer.device)

        def loss_fn(logits, targets):
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        # scale_grads (the default) divides by the microbatch count, as our per-microbatch loss does.
        self.schedule = Schedule1F1B(stage, trainer.config.pipeline.microbatches, loss_fn=loss_fn)

    def train_step(self) -> None:
        import torch.distributed as dist

        from rayshard.actors.parallel.gradient_norm import clip_grad_norm
        from rayshard.plans.training.lr_schedule import learning_rate

        trainer, config = self.trainer, self.trainer.config
        opt, pp_rank, last = config.optimizer, trainer.coords.pp, trainer.layout.pp - 1
        lr = learning_rate(trainer.step, opt.lr, opt.min_lr, opt.warmup_steps, opt.decay_steps or config.steps)
        for group in trainer.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = trainer._batch()
        losses: list[torch.Tensor] = []
        if pp_rank == 0:
            self.schedule.step(torch.cat(inputs))
        elif pp_rank == last:
            self.schedule.step(target=torch.cat(targets), losses=losses)
        else:
            self.schedule.step()
        clip_grad_norm(self.module.parameters(), opt.grad_clip, trainer.coord_map, copies=trainer.pipeline_copies)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        loss = torch.stack(losses).mean() if losses else torch.zeros(())
        dist.all_reduce(loss)
        trainer.step += 1


def _rank_main(rank: int, config: TrainConfig, port: int, rounds: int, out_dir: str) -> None:
    from rayshard.actors.training.trainer import Trainer

    trainer = Trainer(config, rank, f"tcp://127.0.0.1:{port}")  # builds the 1F1B plan's runner
    zbh1 = build_pipeline_plan(config.model.spec, config.layout, "zbh1", config.pipeline.microbatches)
    ours = {"ours-1f1b": trainer.runner, "ours-zbh1": trainer.runner.with_plan(zbh1)}  # same stages, the other plan
    theirs = _TorchSchedule1F1B(trainer)
    results = {variant: {"steps": [], "cpu": [], "plans": [], "waits": [], "actions": []} for variant in VARIANTS}
    for round_index in range(WARMUP_ROUNDS + rounds):
        for variant in VARIANTS:
            tick, cpu_tick = time.perf_counter(), time.process_time()
            if variant in ours:
                trainer.runner = ours[variant]
                metrics = trainer.train_step()
            else:
                theirs.train_step()
            seconds, cpu = time.perf_counter() - tick, time.process_time() - cpu_tick
            if round_index < WARMUP_ROUNDS:
                continue
            result = results[variant]
            result["steps"].append(seconds)
            result["cpu"].append(cpu)
            if variant in ours:
                result["plans"].append(metrics.pipeline.plan_seconds)
                result["waits"].append(metrics.pipeline.wait_seconds)
                result["actions"].append([[*key, seconds] for key, seconds in metrics.pipeline.action_seconds.items()])
    trainer.shutdown()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _simulated_vs_measured(config: TrainConfig, schedule: str, ranks: list[dict]) -> tuple[float, float]:
    """Median measured plan time (slowest rank per step), and the simulator's replay of the plan
    with every action's median measured time."""
    from rayshard.plans.pipeline.simulator import simulate_measured

    samples: dict[tuple, list[float]] = {}
    for result in ranks:
        for step_actions in result["actions"]:
            for kind, stage, mb, seconds in step_actions:
                samples.setdefault((kind, stage, mb), []).append(seconds)
    durations = {key: statistics.median(values) for key, values in samples.items()}
    plan = build_pipeline_plan(config.model.spec, config.layout, schedule, config.pipeline.microbatches)
    measured = statistics.median(max(result["plans"][step] for result in ranks) for step in range(len(ranks[0]["plans"])))
    return measured, simulate_measured(plan.schedule, durations).step_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant (they alternate)")
    args = parser.parse_args()
    config = TrainConfig(model=ModelChoice.named(args.model), layout=ParallelLayout(pp=args.pp),
                         steps=(WARMUP_ROUNDS + args.steps) * len(VARIANTS), global_batch=args.global_batch,
                         seq_len=args.seq_len, pipeline=PipelineConfig(schedule="1f1b", microbatches=args.microbatches),
                         data=DataConfig(max_bytes=2_000_000)).validate()
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(config, _free_port(), args.steps, out_dir), nprocs=args.pp)
        per_rank = [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(args.pp)]
    median, cpu = {}, {}
    for variant in VARIANTS:
        ranks = [results[variant] for results in per_rank]
        median[variant] = statistics.median(max(rank["steps"][step] for rank in ranks) for step in range(args.steps))
        cpu[variant] = statistics.median(sum(rank["cpu"][step] for rank in ranks) for step in range(args.steps))
    print(f"model {args.model}, pp={args.pp}, {args.microbatches} microbatches, batch {args.global_batch}x{args.seq_len}, "
          f"{args.steps} timed steps each (alternating), gloo on CPU, {os.cpu_count()} cores")
    for variant, title in zip(VARIANTS, ("ours 1F1B", "torch Schedule1F1B", "ours ZB-H1")):
        print(f"  {title + ':':<27}{median[variant]:8.3f} s/step   CPU {cpu[variant]:.3f} s/step over all ranks")
    print(f"  torch 1F1B / ours 1F1B:    {median['torch-1f1b'] / median['ours-1f1b']:8.3f}   (goal >= 1.0)")
    print(f"  ours 1F1B / ours ZB-H1:    {median['ours-1f1b'] / median['ours-zbh1']:8.3f}   (goal >= 1.10)")
    for variant, schedule in (("ours-1f1b", "1f1b"), ("ours-zbh1", "zbh1")):
        ranks = [results[variant] for results in per_rank]
        breakdown = []
        for rank, result in enumerate(ranks):
            compute = statistics.median(sum(seconds for *_, seconds in step) for step in result["actions"])
            breakdown.append(f"{rank}: {compute:.2f}/{statistics.median(result['waits']):.2f}/"
                             f"{statistics.median(result['plans']):.2f}")
        print(f"  {variant} per rank, median s/step compute/waiting/plan: " + "; ".join(breakdown))
        measured, simulated = _simulated_vs_measured(config, schedule, ranks)
        print(f"  {variant} plan: measured {measured:.3f} s, simulated with measured costs {simulated:.3f} s, "
              f"simulated/measured {simulated / measured:.3f}   (goal within 0.85..1.15)")


if __name__ == "__main__":
    main()
