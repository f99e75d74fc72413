"""Training throughput: rayshard's trainer against the same model in Hugging Face transformers.

What a user would pick instead: `transformers.LlamaForCausalLM` of the same sizes, trained in a
plain single-process loop with the same batch, sequence length, optimizer (fused AdamW, the same
hyperparameters, gradient clipping at 1.0), precision, activation checkpointing and compile. For
bf16 the plain loop runs under `torch.autocast(bfloat16)` over float32 weights (the usual
single-device recipe); rayshard makes FSDP2's casts over its one-rank data mesh, bf16 parameters
and float32 gradients (decisions 57 and 80). AC in the plain loop is transformers' own per decoder
layer (`activation_checkpointing_enable`, `gradient_checkpointing_enable` before transformers 5.2x;
non-reentrant; selective passes the same op-level policy as ours through its `context_fn`);
compile is `torch.compile(model)`, whole.
Both run in this process, one rank, alternating step by step after warm-up, and the median step
time of each gives tokens/s, model TFLOP/s and MFU (torchtitan's FLOPs per token; `mfu n/a` on a
CPU). Prints ours/HF: goal >= 1.0 on CPU (small preset), >= 1.3 and MFU >= 40% on one GPU.

    .venv/bin/python bench/throughput.py [--preset small] [--precision fp32|bf16] [--ac none|full|selective]
                                         [--compile] [--batch 4] [--seq-len N] [--steps 6] [--device cpu|cuda]

On cuda the preset defaults to `1b` (Llama 3.2 1B's shape) and sequences to 2048 tokens; on the
CPU to `small` and 128 tokens.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # noqa: E402

from actors.model.block_wrappers import SAVED_OPS  # noqa: E402
from actors.training.trainer import Trainer  # noqa: E402
from plans.checkpoint.hf_families import hf_config  # noqa: E402
from plans.config import OptimizerConfig, TrainConfig  # noqa: E402
from plans.training.flops import throughput  # noqa: E402
from plans.training.model_spec import preset  # noqa: E402

WARMUP = 2


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _saves_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective AC as ours does it (actors/model/block_wrappers.py): keep matmul and attention outputs."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class HuggingFaceLoop:
    """The plain loop: one LlamaForCausalLM, AdamW, autocast for bf16."""

    def __init__(self, config: TrainConfig, device: torch.device):
        settings = hf_config(config.model, "float32")
        settings.pop("torch_dtype"), settings.pop("dtype")
        torch.manual_seed(config.seed)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).to(device).train()
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                           weight_decay=opt.weight_decay, fused=True)
        self.config, self.device = config, device
        if config.ac != "none":
            options = {"use_reentrant": False}
            if config.ac == "selective":
                options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _saves_matmuls)
            # `activation_checkpointing_enable` since transformers 5.2x; before it (the GPU machines'
            # 5.17) only `gradient_checkpointing_enable`, now its deprecated alias. Same options.
            enable = (getattr(self.model, "activation_checkpointing_enable", None)
                      or self.model.gradient_checkpointing_enable)
            enable(options)
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, config.model.vocab_size, (config.global_batch, config.seq_len + 1),
                                    generator=generator).to(device)
        if config.compile:
            self.model = torch.compile(self.model)

    def train_step(self) -> None:
        inputs, targets = self.tokens[:, :-1], self.tokens[:, 1:]
        precision = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.config.precision == "bf16"
                     else contextlib.nullcontext())
        with precision:
            logits = self.model(input_ids=inputs, use_cache=False).logits  # training: no KV cache
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optimizer.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()


def _timed(step) -> tuple[float, float]:
    """Wall seconds, and this thread's CPU seconds: on a CPU both loops run on this one thread
    (torch.set_num_threads(1)), so CPU time is the same work measured without the time the
    thread waited for a core that other processes held (a shared machine's noise)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    tick, cpu_tick = time.perf_counter(), time.thread_time()
    step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - tick, time.thread_time() - cpu_tick


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", help="model preset (default: small on cpu, 1b on cuda where one exists)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--ac", choices=("none", "full", "selective"), default="none")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default: 128 on cpu, 2048 on cuda)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each, after warm-up")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.preset is None:
        args.preset = "small" if args.device == "cpu" else "1b"
    if args.seq_len is None:
        args.seq_len = 128 if args.device == "cpu" else 2048
    torch.set_num_threads(1)
    config = TrainConfig(model_preset=args.preset, model=preset(args.preset), global_batch=args.batch, seq_len=args.seq_len,
                         steps=WARMUP + args.steps, precision=args.precision, ac=args.ac, compile=args.compile,
                         optimizer=OptimizerConfig(warmup_steps=0), store="/tmp/rayshard-bench-throughput").validate()
    device = torch.device(args.device)
    if args.device == "cuda":
        torch.cuda.set_device(0)
    ours = Trainer(config, 0, f"tcp://127.0.0.1:{_free_port()}", device=args.device)
    theirs = HuggingFaceLoop(config, device)
    times = {"rayshard": [], "transformers": []}
    cpu_times = {"rayshard": [], "transformers": []}
    for index in range(WARMUP + args.steps):  # alternate, so both see the same machine
        for name, step in (("rayshard", ours.train_step), ("transformers", theirs.train_step)):
            seconds, cpu_seconds = _timed(step)
            if index >= WARMUP:
                times[name].append(seconds)
                cpu_times[name].append(cpu_seconds)
    ours.shutdown()
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    tokens = args.batch * args.seq_len
    print(f"{args.preset} ({sum(p.numel() for p in theirs.model.parameters()) / 1e6:.1f}M parameters), batch {args.batch} "
          f"x {args.seq_len} tokens, {args.precision}, ac {args.ac}{', compile' if args.compile else ''}, "
          f"{device_name}, {args.steps} timed steps each after {WARMUP} warm-up, alternating")
    medians = {}
    for name, samples in times.items():
        medians[name] = statistics.median(samples)
        speed = throughput(config.model, args.seq_len, tokens, medians[name], 1, device_name, args.precision)
        print(f"  {name:<13} median step {medians[name] * 1000:8.1f} ms | {speed.describe()}")
    ratio = medians["transformers"] / medians["rayshard"]
    goal = 1.0 if args.device == "cpu" else 1.3
    if args.device == "cpu":
        cpu_ratio = statistics.median(cpu_times["transformers"]) / statistics.median(cpu_times["rayshard"])
        print(f"ours/HF by this thread's CPU time per step {cpu_ratio:.2f} (the same work, without waits for a core)")
    print(f"ours/HF {ratio:.2f} (tokens/s ratio; goal >= {goal}: {'met' if ratio >= goal else 'MISSED'})")


if __name__ == "__main__":
    main()
