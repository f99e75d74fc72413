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
One rank (one core on a CPU, one GPU), alternating step by step after warm-up; the median step
time of each gives tokens/s, model TFLOP/s and MFU (torchtitan's FLOPs per token; `mfu n/a` on a
CPU). rayshard's trainer runs in this process. On a CPU the plain loop runs in a process of its
own (as a user runs it), so what rayshard sets for its CPU ranks' processes (the host allocator:
`actors/training/host_allocator.py`, decision 84) does not reach it, and the same loop also runs
inside this process, where those settings do reach it: that ratio is the code's alone. On a GPU
the plain loop runs in this process (the host allocator is not set for GPU ranks). Prints ours/HF:
goal >= 1.0 on CPU (small preset; by thread CPU time per step: both loops are single-threaded, and
the bench's byte-level corpus is read in the step's own thread, no prefetch thread), >= 1.3 and
MFU >= 40% on one GPU.

    .venv/bin/python bench/throughput.py [--preset small] [--precision fp32|bf16] [--ac none|full|selective]
                                         [--compile] [--batch 4] [--seq-len N] [--steps 6] [--device cpu|cuda]

On cuda the preset defaults to `1b` (Llama 3.2 1B's shape) and sequences to 2048 tokens; on the
CPU to `small` and 128 tokens.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import multiprocessing.connection
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts  # noqa: E402

from rayshard.actors.parallel.block_wrappers import SAVED_OPS  # noqa: E402
from rayshard.actors.training.trainer import Trainer  # noqa: E402
from rayshard.plans.interop.hf_families import hf_config  # noqa: E402
from rayshard.plans.config import ModelChoice, NumericsConfig, OptimizerConfig, TrainConfig  # noqa: E402
from rayshard.plans.training.flops import throughput  # noqa: E402

WARMUP = 2
IN_PROCESS = "transformers (in rayshard's process)"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _saves_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Selective AC as ours does it (actors/parallel/block_wrappers.py): keep matmul and attention outputs."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class HuggingFaceLoop:
    """The plain loop: one LlamaForCausalLM, AdamW, autocast for bf16."""

    def __init__(self, config: TrainConfig, device: torch.device, convert=None):
        """convert: a function of the built model returning the model to train (bench/lora.py's
        `peft.get_peft_model`); the optimizer and the clip then cover its trainable parameters."""
        settings = hf_config(config.model.spec, "float32")
        settings.pop("torch_dtype"), settings.pop("dtype")
        torch.manual_seed(config.seed)
        self.model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings)).to(device).train()
        if convert is not None:
            self.model = convert(self.model)
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(self.trained, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps,
                                           weight_decay=opt.weight_decay, fused=True)
        self.config, self.device = config, device
        if config.numerics.ac != "none":
            options = {"use_reentrant": False}
            if config.numerics.ac == "selective":
                options["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _saves_matmuls)
            # `activation_checkpointing_enable` since transformers 5.2x; before it (the GPU machines'
            # 5.17) only `gradient_checkpointing_enable`, now its deprecated alias. Same options.
            enable = (getattr(self.model, "activation_checkpointing_enable", None)
                      or self.model.gradient_checkpointing_enable)
            enable(options)
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, config.model.spec.vocab_size, (config.global_batch, config.seq_len + 1),
                                    generator=generator).to(device)
        if config.numerics.compile:
            self.model = torch.compile(self.model)

    def train_step(self) -> None:
        inputs, targets = self.tokens[:, :-1], self.tokens[:, 1:]
        precision = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self.config.numerics.precision == "bf16"
                     else contextlib.nullcontext())
        with precision:
            logits = self.model(input_ids=inputs, use_cache=False).logits  # training: no KV cache
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.trained, self.config.optimizer.grad_clip, foreach=True)
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


def _parse_args() -> argparse.Namespace:
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
    return args


def _config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(model=ModelChoice.named(args.preset), global_batch=args.batch, seq_len=args.seq_len,
                       steps=WARMUP + args.steps,
                       numerics=NumericsConfig(precision=args.precision, ac=args.ac, compile=args.compile),
                       optimizer=OptimizerConfig(warmup_steps=0), store="/tmp/rayshard-bench-throughput").validate()


def _one_core_per_rank(args: argparse.Namespace) -> None:
    """One rank is one core on a CPU (rayshard's actors set the same); on a GPU, the GPU."""
    torch.set_num_threads(1)
    if args.device == "cuda":
        torch.cuda.set_device(0)


def _anchor_process(conn, args: dict) -> None:
    """The Hugging Face loop in a process of its own, as a user runs it: nothing rayshard sets for
    its ranks' processes (the host allocator, `actors/training/host_allocator.py`) reaches it. It
    steps when told, so the two still alternate step by step."""
    namespace = argparse.Namespace(**args)
    _one_core_per_rank(namespace)
    loop = HuggingFaceLoop(_config(namespace), torch.device(namespace.device))
    conn.send("ready")
    while conn.recv() == "step":
        conn.send(_timed(loop.train_step))


class AnchorProcess:
    """The parent's handle on `_anchor_process`. Every wait is bounded, and ends early with the
    child's exit code if the child dies (an import error, memory)."""

    def __init__(self, args: argparse.Namespace, timeout_s: float = 600.0, target=_anchor_process):
        """target: the child's function, (conn, vars(args)) -> None, stepping as `_anchor_process` does."""
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.timeout_s = timeout_s
        self.process = context.Process(target=target, args=(child, vars(args)), daemon=True)
        self.process.start()
        child.close()  # the child's end lives in the child alone, so its death closes the pipe
        self._receive("build the model")

    def _receive(self, what: str):
        ready = multiprocessing.connection.wait([self.conn, self.process.sentinel], self.timeout_s)
        if self.conn in ready:
            try:
                return self.conn.recv()
            except EOFError:  # the child's end closed: it died
                pass
        if ready:  # it is exiting: let it, for its exit code
            self.process.join(10)
        self.process.kill()
        self.process.join(10)
        if not ready:
            raise TimeoutError(f"the transformers process did not {what} in {self.timeout_s:.0f} s")
        raise RuntimeError(f"the transformers process died before it could {what} (exit code {self.process.exitcode})")

    def timed_step(self) -> tuple[float, float]:
        self.conn.send("step")
        return self._receive("finish a step")

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send("stop")
            except OSError:
                pass
            self.process.join(60)
        if self.process.is_alive():
            self.process.kill()


def _measure(args: argparse.Namespace, config: TrainConfig, ours: Trainer, anchor: AnchorProcess | None):
    """Alternate the loops step by step after warm-up; (wall seconds, CPU seconds) by loop name."""
    # On a GPU the host allocator is not in the step (the Trainer sets it on CPU ranks only), and a
    # second 1b model and CUDA context would crowd the GPU: there the plain loop runs here alone.
    in_process = HuggingFaceLoop(config, torch.device(args.device))
    loops = {"rayshard": lambda: _timed(ours.train_step), "transformers": lambda: _timed(in_process.train_step)}
    if anchor is not None:
        # The plain loop in its own process is the anchor; the copy here, where rayshard's process
        # settings reach it, differs from ours by the code alone.
        loops = {"rayshard": loops["rayshard"], "transformers": anchor.timed_step, IN_PROCESS: loops["transformers"]}
    times = {name: [] for name in loops}
    cpu_times = {name: [] for name in loops}
    for index in range(WARMUP + args.steps):  # alternate, so all see the same machine
        for name, timed_step in loops.items():
            seconds, cpu_seconds = timed_step()
            if index >= WARMUP:
                times[name].append(seconds)
                cpu_times[name].append(cpu_seconds)
    return times, cpu_times, sum(p.numel() for p in in_process.model.parameters())


def main() -> None:
    args = _parse_args()
    _one_core_per_rank(args)
    config = _config(args)
    ours = Trainer(config, 0, f"tcp://127.0.0.1:{_free_port()}", device=args.device)
    anchor = AnchorProcess(args) if args.device == "cpu" else None
    try:
        times, cpu_times, parameters = _measure(args, config, ours, anchor)
    finally:
        ours.shutdown()
        if anchor is not None:
            anchor.close()
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    tokens = args.batch * args.seq_len
    print(f"{args.preset} ({parameters / 1e6:.1f}M parameters), batch {args.batch} "
          f"x {args.seq_len} tokens, {args.precision}, ac {args.ac}{', compile' if args.compile else ''}, "
          f"{device_name}, {args.steps} timed steps each after {WARMUP} warm-up, alternating")
    medians = {}
    for name, samples in times.items():
        medians[name] = statistics.median(samples)
        speed = throughput(config.model.spec, args.seq_len, tokens, medians[name], 1, device_name, args.precision)
        print(f"  {name:<38} median step {medians[name] * 1000:8.1f} ms | {speed.describe()}")
    goal = 1.0 if args.device == "cpu" else 1.3
    print(f"ours/HF {medians['transformers'] / medians['rayshard']:.2f} (tokens/s)")
    if args.device == "cpu":
        cpu = {name: statistics.median(samples) for name, samples in cpu_times.items()}
        print(f"ours/HF by CPU time per step, HF in rayshard's process {cpu[IN_PROCESS] / cpu['rayshard']:.3f} "
              "(the code alone: both under rayshard's process settings)")
        ratio = cpu["transformers"] / cpu["rayshard"]  # both single-threaded: the work without waits for a core
    else:
        ratio = medians["transformers"] / medians["rayshard"]
    print(f"ours/HF {ratio:.3f}{' by CPU time per step' if args.device == 'cpu' else ''}: "
          f"goal >= {goal}: {'met' if ratio >= goal else 'MISSED'}")


if __name__ == "__main__":
    main()
