"""LoRA: a LoRA step against a full fine-tuning step, and against transformers + peft.

Two comparisons, each measured in the same run as its anchor:

1. LoRA / full fine-tuning, same model, same layout (`--layout`, one rank by default): each variant
   runs in fresh processes (one per rank, torch.multiprocessing + gloo or NCCL, the same `Trainer`
   the Ray actors run), the two alternating `--repeat` times. Reported: the median step time over
   rank 0 and the peak memory per rank (the largest over timed steps, as the trainer reports it in
   `StepMetrics.peak_memory_bytes`: the CUDA allocator's peak on a GPU; on a CPU the process's peak
   resident set less its resident set before the trainer was built, the base of Python and torch).
   Figures: LoRA/full step time and peak memory (report; a LoRA step skips the base's weight
   gradients and moments, so both should be below 1).
2. ours / transformers + peft, one rank: `transformers.LlamaForCausalLM` of the same sizes wrapped
   by `peft.get_peft_model` with the same rank, alpha and target projections (q_proj, k_proj,
   v_proj, o_proj, gate_proj, up_proj, down_proj for q, k, v, o, gate, up, down), trained in a
   plain loop with fused AdamW over its trainable parameters, the same hyperparameters and clip
   (`bench/throughput.py`'s loop, which this reuses). As there, on a CPU the plain loop runs in a
   process of its own (as a user runs it) and the same loop in this process too (the code alone),
   alternating step by step with ours; the CPU figure is by thread CPU time per step (both loops
   single-threaded). Goal ours/peft >= 1.0 on a CPU (report on a GPU).

    .venv/bin/python bench/lora.py [--preset small] [--layout dp=2] [--precision fp32|bf16] [--ac none|full|selective]
                                   [--compile] [--lora-rank 8] [--lora-alpha 16] [--lora-targets q,k,v,o,gate,up,down]
                                   [--batch 4] [--seq-len N] [--steps 6] [--repeat 3] [--device cpu|cuda]

On cuda the preset defaults to `1b` and sequences to 2048 tokens (as bench/throughput.py); one GPU
runs a one-rank layout.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from dataclasses import replace

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import throughput  # noqa: E402  (bench/throughput.py: the plain loop, its process, the timing)
from rayshard.actors.training.device_memory import resident_memory_bytes  # noqa: E402
from rayshard.actors.training.trainer import Trainer  # noqa: E402
from rayshard.plans.config.lora import LoraConfig  # noqa: E402
from rayshard.plans.layout.parallel_layout import ParallelLayout  # noqa: E402

WARMUP = throughput.WARMUP
# Our logical projections as transformers' Llama names its modules (peft's target_modules).
PEFT_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                "down": "down_proj"}


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", help="model preset (default: small on cpu, 1b on cuda)")
    parser.add_argument("--layout", default="dp=1", help="layout of the LoRA/full comparison, e.g. dp=2 or fsdp=2,tp=2")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--ac", choices=("none", "full", "selective"), default="none")
    parser.add_argument("--compile", action="store_true", help="ours per block as the trainer does; peft's model whole")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-targets", default="q,k,v,o,gate,up,down")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: 128 on cpu, 2048 on cuda)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each, after warm-up")
    parser.add_argument("--repeat", type=int, default=3, help="alternating runs of LoRA and full (comparison 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--skip-full", action="store_true", help="only the comparison with transformers + peft")
    args = parser.parse_args()
    if args.preset is None:
        args.preset = "small" if args.device == "cpu" else "1b"
    if args.seq_len is None:
        args.seq_len = 128 if args.device == "cpu" else 2048
    return args


def _lora(args: argparse.Namespace) -> LoraConfig:
    return LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets)


def _config(args: argparse.Namespace, lora: bool, layout: ParallelLayout = ParallelLayout()):
    config = throughput._config(args)
    return replace(config, layout=layout, lora=_lora(args) if lora else LoraConfig()).validate()


# ---- 1. LoRA against full fine-tuning on the same layout ---------------------------------------

def _rank(rank, config, port, device, queue):
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    base = resident_memory_bytes()  # before the model: Python, torch and the bench's imports
    trainer = Trainer(config, rank, f"tcp://127.0.0.1:{port}", device=device)
    times, cpu_times, peaks = [], [], []
    for index in range(config.steps):
        step_metrics = []
        # ends in an all-reduce of the loss: every rank has finished it
        _, cpu_seconds = throughput._timed(lambda: step_metrics.append(trainer.train_step()))
        metrics = step_metrics[0]
        if index >= WARMUP:
            times.append(metrics.rank_seconds)
            cpu_times.append(cpu_seconds)
            # on a CPU the peak resident set counts the process's base too: leave it out
            peaks.append(metrics.peak_memory_bytes - (base if device == "cpu" else 0))
    queue.put((rank, statistics.median(times), max(peaks), statistics.median(cpu_times)))
    trainer.shutdown()


def run_layout(config, device: str) -> tuple[float, list[int], float]:
    """Fresh processes, one per rank: (rank 0's median step seconds, each rank's peak bytes, rank
    0's median step in thread CPU seconds). bench/posttrain.py runs its variants through it too."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(config, port, device, queue), nprocs=config.layout.world_size)
    results = sorted(queue.get() for _ in range(config.layout.world_size))
    return results[0][1], [peak for _, _, peak, _ in results], results[0][3]


def lora_against_full(args: argparse.Namespace) -> None:
    layout = ParallelLayout.parse(args.layout)
    configs = {"full": _config(args, False, layout), "lora": _config(args, True, layout)}
    seconds = {name: [] for name in configs}
    peaks = {name: [] for name in configs}
    for attempt in range(args.repeat):  # alternate, so both see the same machine
        for name, config in configs.items():
            step, rank_peaks, _ = run_layout(config, args.device)
            seconds[name].append(step)
            peaks[name].append(rank_peaks)
            print(f"  [{attempt + 1}/{args.repeat}] {name}: {step * 1e3:.1f} ms/step, peak per rank "
                  f"{', '.join(f'{p / 2**20:.0f}' for p in rank_peaks)} MiB", flush=True)
    step = {name: statistics.median(values) for name, values in seconds.items()}
    # each rank's median peak over the repeats
    peak = {name: [statistics.median(run[r] for run in runs) for r in range(layout.world_size)]
            for name, runs in peaks.items()}
    what = "CUDA allocator peak" if args.device == "cuda" else "peak resident set above the process's before the model"
    print(f"LoRA / full fine-tuning on {layout.describe()} ({args.preset}, {args.precision}, ac {args.ac}"
          f"{', compile' if args.compile else ''}, "
          f"rank {args.lora_rank}, targets {args.lora_targets}), medians of {args.repeat}:")
    print(f"  step time   full {step['full'] * 1e3:.1f} ms, LoRA {step['lora'] * 1e3:.1f} ms: "
          f"LoRA/full = {step['lora'] / step['full']:.2f}")
    for rank in range(layout.world_size):
        full, lora = peak["full"][rank], peak["lora"][rank]
        print(f"  rank {rank} peak memory ({what})   full {full / 2**20:.0f} MiB, LoRA {lora / 2**20:.0f} MiB: "
              f"LoRA/full = {lora / full:.2f}")


# ---- 2. ours against transformers + peft on one rank ------------------------------------------

def _peft_model(model, args: dict):
    import peft

    targets = [PEFT_MODULES[t.strip()] for t in args["lora_targets"].split(",") if t.strip()]
    return peft.get_peft_model(model, peft.LoraConfig(r=args["lora_rank"], lora_alpha=args["lora_alpha"],
                                                      lora_dropout=0.0, target_modules=targets))


def _peft_anchor(conn, args: dict) -> None:
    """throughput.py's `_anchor_process` with the model wrapped by peft."""
    namespace = argparse.Namespace(**args)
    throughput._one_core_per_rank(namespace)
    loop = throughput.HuggingFaceLoop(_config(namespace, True), torch.device(namespace.device),
                                      convert=lambda model: _peft_model(model, args))
    conn.send("ready")
    while conn.recv() == "step":
        conn.send(throughput._timed(loop.train_step))


def ours_against_peft(args: argparse.Namespace) -> None:
    throughput._one_core_per_rank(args)
    config = _config(args, True)
    ours = Trainer(config, 0, f"tcp://127.0.0.1:{throughput._free_port()}", device=args.device)
    anchor = throughput.AnchorProcess(args, target=_peft_anchor) if args.device == "cpu" else None
    try:
        in_process = throughput.HuggingFaceLoop(config, torch.device(args.device),
                                                convert=lambda model: _peft_model(model, vars(args)))
        loops = {"rayshard": lambda: throughput._timed(ours.train_step),
                 "transformers + peft": lambda: throughput._timed(in_process.train_step)}
        if anchor is not None:
            loops = {"rayshard": loops["rayshard"], "transformers + peft": anchor.timed_step,
                     "transformers + peft (in rayshard's process)": loops["transformers + peft"]}
        times = {name: [] for name in loops}
        cpu_times = {name: [] for name in loops}
        for index in range(WARMUP + args.steps):  # alternate, so all see the same machine
            for name, timed_step in loops.items():
                seconds, cpu_seconds = timed_step()
                if index >= WARMUP:
                    times[name].append(seconds)
                    cpu_times[name].append(cpu_seconds)
        trainable = sum(p.numel() for p in in_process.trained)
    finally:
        ours.shutdown()
        if anchor is not None:
            anchor.close()
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"ours / transformers + peft, 1 rank, {args.preset}, batch {args.batch} x {args.seq_len}, {args.precision}, "
          f"ac {args.ac}{', compile' if args.compile else ''}, rank {args.lora_rank} on {args.lora_targets} ({trainable / 1e6:.2f}M trainable), "
          f"{device_name}, {args.steps} timed steps each after {WARMUP} warm-up, alternating")
    wall = {name: statistics.median(samples) for name, samples in times.items()}
    cpu = {name: statistics.median(samples) for name, samples in cpu_times.items()}
    for name in loops:
        print(f"  {name:<45} median step {wall[name] * 1e3:8.1f} ms (CPU {cpu[name] * 1e3:8.1f} ms)")
    anchor_name = "transformers + peft"
    print(f"ours/peft {wall[anchor_name] / wall['rayshard']:.3f} (wall)")
    if args.device == "cpu":
        print(f"ours/peft by CPU time, peft in rayshard's process "
              f"{cpu['transformers + peft (in rayshard' + chr(39) + 's process)'] / cpu['rayshard']:.3f} (the code alone)")
        ratio = cpu[anchor_name] / cpu["rayshard"]
        print(f"ours/peft {ratio:.3f} by CPU time per step: goal >= 1.0: {'met' if ratio >= 1.0 else 'MISSED'}")


def main() -> None:
    args = _parse_args()
    if not args.skip_full:
        lora_against_full(args)
    ours_against_peft(args)


if __name__ == "__main__":
    main()
