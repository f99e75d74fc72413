"""Benchmark: checking and simulating a large pipeline plan, against torch.distributed.pipelining.

    .venv/bin/python bench/plans.py [--pp 64] [--microbatches 512] [--vpp 2] [--repeats 5]

For each schedule that both sides offer at vpp=2 (interleaved 1F1B, ZB-V, DualPipeV) it times,
on this machine and in this run:
- ours: build the compute schedule, lower it with send/recv, check it (blocking-rendezvous
  deadlock search plus every dependency), simulate time and memory; median of --repeats runs;
- torch: its own generator (`_calculate_single_rank_operations` on every rank), its lowering
  (`_add_send_recv`) and its dry-run `_simulate_comms_compute`; median of --torch-repeats runs
  (slow: it rescans every rank each simulated step).
The target is check + simulate under 2 s at pp=64, 512 microbatches, vpp=2.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

# Run as a script, this file's folder comes first on sys.path and its name would shadow the
# `plans` package; look the package up from the repository root instead.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [entry for entry in sys.path if os.path.abspath(entry or ".") != _HERE]
sys.path.insert(0, os.path.dirname(_HERE))

from rayshard.plans.pipeline.checker import check  # noqa: E402
from rayshard.plans.pipeline.lowering import lower  # noqa: E402
from rayshard.plans.pipeline.schedules import build_schedule  # noqa: E402
from rayshard.plans.pipeline.simulator import simulate  # noqa: E402

TARGET_SECONDS = 2.0


def time_ours(name: str, pp: int, microbatches: int, vpp: int) -> dict[str, float]:
    times = {}
    started = time.perf_counter()
    schedule = build_schedule(name, pp, microbatches, vpp)
    times["generate"] = time.perf_counter() - started
    started = time.perf_counter()
    lowered = lower(schedule)
    times["lower"] = time.perf_counter() - started
    started = time.perf_counter()
    report = check(lowered)
    times["check"] = time.perf_counter() - started
    if not report.ok:
        raise SystemExit(report.describe())
    started = time.perf_counter()
    simulate(lowered, checked=report)
    times["simulate"] = time.perf_counter() - started
    times["actions"] = sum(len(actions) for actions in lowered.ranks)
    return times


def torch_compute_schedule(name: str, pp: int, microbatches: int, vpp: int):
    """torch's per-rank compute lists and stage->rank map, built without process groups."""
    from torch.distributed.pipelining import schedules as torch_schedules

    classes = {
        "interleaved1f1b": torch_schedules.ScheduleInterleaved1F1B,
        "zbv": torch_schedules.ScheduleZBVZeroBubble,
        "dualpipev": torch_schedules.ScheduleDualPipeV,
    }
    # The constructors want live pipeline stages; the generators only read these fields.
    schedule = object.__new__(classes[name])
    schedule.pp_group_size, schedule.n_local_stages = pp, vpp
    schedule._n_microbatches, schedule.num_stages = microbatches, pp * vpp
    schedule.number_of_rounds = max(1, microbatches // pp)
    schedule.microbatches_per_round = microbatches // schedule.number_of_rounds
    if name == "interleaved1f1b":
        stage_rank = {stage: stage % pp for stage in range(pp * vpp)}
    else:
        stage_rank = {stage: stage if stage < pp else 2 * pp - 1 - stage for stage in range(pp * vpp)}
    compute = {rank: schedule._calculate_single_rank_operations(rank) for rank in range(pp)}
    return compute, stage_rank.__getitem__


def time_torch(name: str, pp: int, microbatches: int, vpp: int) -> dict[str, float] | str:
    from torch.distributed.pipelining import schedules as torch_schedules

    times = {}
    started = time.perf_counter()
    compute, stage_to_rank = torch_compute_schedule(name, pp, microbatches, vpp)
    times["generate"] = time.perf_counter() - started
    started = time.perf_counter()
    compute = {rank: [a for a in actions if a is not None] for rank, actions in compute.items()}
    lowered = torch_schedules._add_send_recv(compute, stage_to_rank, pp * vpp)
    times["lower"] = time.perf_counter() - started
    started = time.perf_counter()
    try:
        torch_schedules._simulate_comms_compute(lowered, stage_to_rank, pp * vpp)
    except (ValueError, KeyError) as error:  # DualPipeV: OVERLAP_F_B has stage -1, unsimulated
        return f"_simulate_comms_compute fails on this schedule ({type(error).__name__}: {error})"
    times["simulate"] = time.perf_counter() - started
    times["actions"] = sum(len(actions) for actions in lowered.values())
    return times


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=512)
    parser.add_argument("--vpp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="runs of ours; the median is printed")
    parser.add_argument("--torch-repeats", type=int, default=1, help="runs of torch's (about 10 s each at the default size)")
    parser.add_argument("--schedules", default="interleaved1f1b,zbv,dualpipev")
    args = parser.parse_args()
    shape = f"pp={args.pp}, {args.microbatches} microbatches, vpp={args.vpp}"
    print(f"pipeline plans at {shape}; ours: median of {args.repeats}, torch: median of {args.torch_repeats}\n")
    met = True
    for name in args.schedules.split(","):
        ours = median_of([time_ours(name, args.pp, args.microbatches, args.vpp) for _ in range(args.repeats)])
        check_and_simulate = ours["check"] + ours["simulate"]
        whole = check_and_simulate + ours["generate"] + ours["lower"]
        met &= check_and_simulate < TARGET_SECONDS
        print(f"{name}: {int(ours['actions'])} lowered actions")
        print(f"  ours   check {ours['check']:.3f} s + simulate {ours['simulate']:.3f} s = "
              f"{check_and_simulate:.3f} s (target < {TARGET_SECONDS:g} s: "
              f"{'met' if check_and_simulate < TARGET_SECONDS else 'MISSED'}); "
              f"with generate {ours['generate']:.3f} s + lower {ours['lower']:.3f} s: {whole:.3f} s")
        torch_runs = [time_torch(name, args.pp, args.microbatches, args.vpp) for _ in range(args.torch_repeats)]
        if isinstance(torch_runs[0], str):
            print(f"  torch  {torch_runs[0]}; no ratio")
            continue
        theirs = median_of(torch_runs)
        torch_whole = theirs["generate"] + theirs["lower"] + theirs["simulate"]
        print(f"  torch  generate {theirs['generate']:.3f} s + lower {theirs['lower']:.3f} s + "
              f"_simulate_comms_compute {theirs['simulate']:.3f} s = {torch_whole:.3f} s "
              f"({int(theirs['actions'])} actions)")
        print(f"  ratio  torch / ours: whole pipeline {torch_whole / whole:.1f}x, "
              f"simulation (torch's dry run vs our check + simulate) {theirs['simulate'] / check_and_simulate:.1f}x")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
