"""Post-training: DPO's step time (live reference, precomputed reference, TRL) and memory.

One rank on a CPU, one model (`--preset`, small by default) and one batch shape (`--batch`
sequences of `--seq-len` tokens; under DPO two sequences per pair), each variant in a fresh
process (bench/lora.py's `run_layout`: the `Trainer` the Ray actors run, torch.multiprocessing +
gloo), `--repeats` rounds alternating the variants so all see the same machine; medians over
the rounds of each process's median step.

The data: a byte-level BPE (320 ids, the model's vocabulary) and made-up pairs of words, prepared
on a local Ray of one CPU (`prepare_dataset`, as `rayshard data prepare --format preference`; the
same prompts and chosen responses as `--format sft` for the SFT variants). Every row is padded to
the sequence length, so each variant's step runs the same `batch x seq_len` tokens. The precomputed
reference's file is written by `Trainer.reference_logprobs` (what `rayshard data reference-logprobs`
runs on its rank actor) from the seeded initial weights, which are a fresh run's reference.

1. Step time. live / precomputed: a DPO step with the frozen copy's forward against one that reads
   the reference's log-probabilities with the rows (report; the reference's forward is a third of
   a step's matmuls or so, so expect about 1.3x). ours (live) / TRL: TRL's `DPOTrainer` (trl
   installed beside the pinned torch, which it left alone) on a `transformers.LlamaForCausalLM` of
   the same sizes (bench/throughput.py's), its reference the copy TRL makes itself, the sigmoid
   loss with the same beta, per-device batch = the pairs, `pad_to_multiple_of` the sequence length
   (so its rows are as long as ours), fused AdamW with our hyperparameters, clip 1.0, constant lr;
   timed from `on_step_begin` to `on_step_end` (forward, backward, clip, optimizer; its batch is
   collated before, ours read in the step). By thread CPU time per step (both single-threaded:
   torch.set_num_threads(1)); wall times printed beside. Goal ours/TRL >= 1.0.
2. Peak memory, as the trainer reports it (`StepMetrics.peak_memory_bytes` on a CPU: the rank
   process's peak resident set during the step, from /proc) less the process's resident set
   before the trainer was built (Python, torch and the imports); the largest over the timed steps.
   LoRA-DPO / LoRA-SFT (same rank and targets; goal <= 1.1) and DPO with a precomputed reference
   / SFT of the whole model (goal <= 1.05).

    .venv/bin/python bench/posttrain.py [--preset small] [--batch 8] [--seq-len 128] [--steps 6] [--repeats 3]
                                        [--lora-rank 8] [--lora-targets q,k,v,o,gate,up,down] [--skip-trl]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue as queues
import statistics
import sys
import tempfile
from dataclasses import replace

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import lora  # noqa: E402  (bench/lora.py: a variant in fresh rank processes, its step time and peak memory)
import throughput  # noqa: E402  (bench/throughput.py: the transformers model, the timing, one core per rank)
from rayshard.actors.training.trainer import Trainer  # noqa: E402
from rayshard.plans.config import DataConfig, DpoConfig, LoraConfig, ModelChoice, TrainConfig  # noqa: E402
from rayshard.plans.data.reference_logprobs import reference_logprobs_file  # noqa: E402

WARMUP = throughput.WARMUP
VOCAB = 320
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()
VARIANTS = ("dpo-live", "dpo-precomputed", "sft", "lora-dpo", "lora-sft")


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (two per DPO pair)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=6, help="timed steps of each, after warm-up")
    parser.add_argument("--repeats", type=int, default=3, help="alternating rounds of every variant")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-targets", default="q,k,v,o,gate,up,down")
    parser.add_argument("--pairs", type=int, default=64, help="preference pairs in the made-up dataset")
    parser.add_argument("--skip-trl", action="store_true", help="no TRL anchor (ours/TRL is not reported)")
    args = parser.parse_args()
    # bench/throughput.py's config fields this bench does not vary
    args.precision, args.ac, args.compile, args.device = "fp32", "none", False, "cpu"
    return args


# ---- the data ----------------------------------------------------------------------------------

def _rows(count: int, seq_len: int) -> list[dict]:
    """Pairs of words whose prompt + longer response stay within the sequence (about 2 tokens a word)."""
    rng = np.random.default_rng(0)
    words = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    most = max(4, seq_len // 2 - 4)  # words per example, all told
    rows = []
    for _ in range(count):
        prompt = int(rng.integers(2, most // 2))
        rows.append({"prompt": words(prompt) + ":", "chosen": " " + words(int(rng.integers(1, most - prompt))),
                     "rejected": " " + words(int(rng.integers(1, most - prompt)))})
    return rows


def prepare_data(args: argparse.Namespace, root: str) -> dict[str, str]:
    """{'preference': URL, 'sft': URL}: both prepared on a local Ray of one CPU, then shut down."""
    import ray

    from rayshard.cluster.data.documents import ReadOptions
    from rayshard.cluster.data.prepare import prepare_dataset
    from rayshard.cluster.data.tokenizer import save_tokenizer, train_tokenizer

    rows = _rows(args.pairs, args.seq_len)
    with open(f"{root}/words.txt", "w") as out:
        out.write(" ".join(WORDS * 20))
    tokenizer = train_tokenizer([f"{root}/words.txt"], VOCAB)
    save_tokenizer(tokenizer, f"{root}/tokenizer")  # TRL's, as a transformers tokenizer
    os.makedirs(f"{root}/in-preference"), os.makedirs(f"{root}/in-sft")
    with open(f"{root}/in-preference/pairs.jsonl", "w") as out:
        out.write("\n".join(json.dumps(row) for row in rows) + "\n")
    with open(f"{root}/in-sft/examples.jsonl", "w") as out:
        out.write("\n".join(json.dumps({"prompt": r["prompt"], "completion": r["chosen"]}) for r in rows) + "\n")
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    try:
        urls = {}
        for kind in ("preference", "sft"):
            urls[kind] = f"{root}/{kind}"
            prepare_dataset([f"{root}/in-{kind}"], tokenizer, urls[kind], ReadOptions(format=kind), cpus_per_task=0,
                            log=lambda *_: None)
    finally:
        ray.shutdown()
    return urls


def _reference_logprobs(rank, config, port, url, results):
    trainer = Trainer(config, rank, f"tcp://127.0.0.1:{port}")
    results.put(trainer.reference_logprobs(url))
    trainer.shutdown()


# The digest is checked by the driver (cluster/run/reference_logprobs.py), which the bench does not
# run: its file is named by this stand-in, and its precomputed variant's config names that file
# as the driver would (decision 201).
BENCH_DIGEST = "sha256:bench"


def precompute_reference(config: TrainConfig, url: str) -> None:
    """url/reference-logprobs/bench.parquet from the seeded initial weights (a fresh live run's
    reference), computed in a rank process of its own as `rayshard data reference-logprobs` computes it."""
    import fsspec

    from rayshard.plans.data.dataset_index import INDEX, decode_index
    from rayshard.plans.data.reference_logprobs import REFERENCE_LOGPROBS_DIR, encode_reference_logprobs

    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_reference_logprobs, args=(config, throughput._free_port(), url, results), nprocs=1)
    logps = results.get()
    fs, root = fsspec.core.url_to_fs(url)
    meta, _ = decode_index(fs.cat_file(f"{root}/{INDEX}"), f"{url}/{INDEX}")
    fs.makedirs(f"{root}/{REFERENCE_LOGPROBS_DIR}", exist_ok=True)
    fs.pipe_file(f"{root}/{reference_logprobs_file(BENCH_DIGEST)}", encode_reference_logprobs(
        np.asarray(logps), meta.index_hash, {"url": "seeded initial weights", "digest": BENCH_DIGEST}))


# ---- the variants ------------------------------------------------------------------------------

def _config(args: argparse.Namespace, variant: str, urls: dict[str, str]) -> TrainConfig:
    base = throughput._config(args)
    dpo = variant in ("dpo-live", "dpo-precomputed", "lora-dpo")
    lora_config = (LoraConfig(rank=args.lora_rank, alpha=args.lora_alpha, targets=args.lora_targets)
                   if variant.startswith("lora") else LoraConfig())
    return replace(base, model=ModelChoice.named(args.preset, vocab_size=VOCAB), objective="dpo" if dpo else "sft",
                   data=DataConfig(dataset=urls["preference" if dpo else "sft"]),
                   dpo=DpoConfig(precomputed=variant == "dpo-precomputed", logprobs_file=reference_logprobs_file(BENCH_DIGEST)),
                   lora=lora_config).validate()


# ---- the anchor: TRL's DPOTrainer --------------------------------------------------------------

def _trl_process(results, args: dict, config: TrainConfig, rows: list[dict]) -> None:
    """TRL's DPOTrainer in a process of its own: (median wall, median thread CPU) per timed step."""
    import copy
    import time

    import datasets

    import transformers
    import trl

    namespace = argparse.Namespace(**args)
    throughput._one_core_per_rank(namespace)
    from rayshard.cluster.data.tokenizer import load_tokenizer

    loaded = load_tokenizer(args["tokenizer"])
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=loaded.tokenizer, eos_token=loaded.eos_token,
                                                     pad_token=loaded.eos_token)
    model = throughput.HuggingFaceLoop(config, torch.device("cpu")).model
    opt = config.optimizer
    timings = []

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.tick = (time.perf_counter(), time.thread_time())

        def on_step_end(self, *_, **__):
            timings.append((time.perf_counter() - self.tick[0], time.thread_time() - self.tick[1]))

    settings = trl.DPOConfig(
        output_dir=args["trl_out"], per_device_train_batch_size=config.global_batch // 2, max_steps=config.steps,
        learning_rate=opt.lr, adam_beta1=opt.beta1, adam_beta2=opt.beta2, adam_epsilon=opt.eps,
        weight_decay=opt.weight_decay, max_grad_norm=opt.grad_clip, optim="adamw_torch_fused",
        lr_scheduler_type="constant", warmup_steps=0, beta=config.dpo.beta, loss_type=["sigmoid"],
        max_length=config.seq_len, pad_to_multiple_of=config.seq_len, precompute_ref_log_probs=False,
        use_cpu=True, bf16=False, fp16=False, logging_steps=10_000, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, seed=config.seed, data_seed=config.seed)
    # The reference: a frozen copy of the starting weights, as ours without LoRA (TRL would load
    # one from the model's hub name, which a model built in memory has not).
    reference = copy.deepcopy(model).eval().requires_grad_(False)
    trainer = trl.DPOTrainer(model=model, ref_model=reference, args=settings, train_dataset=datasets.Dataset.from_list(rows),
                             processing_class=tokenizer, callbacks=[StepTimes()])
    trainer.train()
    timed = timings[WARMUP:]
    results.put((statistics.median(t for t, _ in timed), statistics.median(c for _, c in timed), len(timings)))


def run_trl(args: argparse.Namespace, config: TrainConfig, rows: list[dict], timeout_s: float = 900.0):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    process = context.Process(target=_trl_process, args=(results, vars(args), config, rows), daemon=True)
    process.start()
    try:
        for _ in range(int(timeout_s / 5)):  # bounded, and ended early by the child's death
            try:
                return results.get(timeout=5)
            except queues.Empty:
                if not process.is_alive():
                    raise RuntimeError(f"TRL's process died (exit code {process.exitcode})") from None
        raise RuntimeError(f"TRL's process gave no result in {timeout_s:.0f} s")
    finally:
        process.join(60)
        if process.is_alive():
            process.kill()


# ---- the run ------------------------------------------------------------------------------------

def main() -> None:
    args = _parse_args()
    root = tempfile.mkdtemp(prefix="rayshard-bench-posttrain-")
    urls = prepare_data(args, root)
    configs = {variant: _config(args, variant, urls) for variant in VARIANTS}
    precompute_reference(configs["dpo-live"], urls["preference"])
    args.tokenizer = f"{root}/tokenizer"
    args.trl_out = f"{root}/trl"
    rows = _rows(args.pairs, args.seq_len)
    wall = {name: [] for name in (*VARIANTS, "trl")}
    cpu = {name: [] for name in wall}
    peak = {name: [] for name in VARIANTS}
    for attempt in range(args.repeats):  # alternate, so all see the same machine
        for variant, config in configs.items():
            step, peaks, cpu_step = lora.run_layout(config, "cpu")
            wall[variant].append(step), cpu[variant].append(cpu_step), peak[variant].append(peaks[0])
            print(f"  [{attempt + 1}/{args.repeats}] {variant:<16} {step * 1e3:7.1f} ms/step (CPU {cpu_step * 1e3:7.1f} ms), "
                  f"peak {peaks[0] / 2**20:5.0f} MiB above base", flush=True)
        if not args.skip_trl:
            step, cpu_step, steps = run_trl(args, configs["dpo-live"], rows)
            wall["trl"].append(step), cpu["trl"].append(cpu_step)
            print(f"  [{attempt + 1}/{args.repeats}] {'trl DPOTrainer':<16} {step * 1e3:7.1f} ms/step (CPU "
                  f"{cpu_step * 1e3:7.1f} ms, {steps} steps)", flush=True)
    med = lambda values: statistics.median(values) if values else float("nan")  # noqa: E731
    wall, cpu, peak = ({k: med(v) for k, v in d.items()} for d in (wall, cpu, peak))
    print(f"{args.preset}, vocabulary {VOCAB}, batch {args.batch} x {args.seq_len} ({args.batch // 2} DPO pairs), fp32, "
          f"1 rank, cpu, {args.steps} timed steps after {WARMUP} warm-up, medians of {args.repeats} rounds; LoRA rank "
          f"{args.lora_rank} on {args.lora_targets}")
    for name in wall:
        if name in peak or not args.skip_trl:
            memory = f", peak {peak[name] / 2**20:.0f} MiB above base" if name in peak else ""
            print(f"  {name:<16} median step {wall[name] * 1e3:7.1f} ms (CPU {cpu[name] * 1e3:7.1f} ms){memory}")
    live = cpu["dpo-live"] / cpu["dpo-precomputed"]
    anchor = cpu["trl"] / cpu["dpo-live"]
    lora_mem = peak["lora-dpo"] / peak["lora-sft"]
    full_mem = peak["dpo-precomputed"] / peak["sft"]
    print(f"live/precomputed {live:.2f} by CPU time ({wall['dpo-live'] / wall['dpo-precomputed']:.2f} wall): report")
    if not args.skip_trl:
        print(f"ours/TRL {anchor:.3f} by CPU time ({wall['trl'] / wall['dpo-live']:.3f} wall): goal >= 1.0: "
              f"{'met' if anchor >= 1.0 else 'MISSED'}")
    print(f"lora-dpo/lora-sft peak memory {lora_mem:.3f}: goal <= 1.1: {'met' if lora_mem <= 1.1 else 'MISSED'}")
    print(f"dpo-precomputed/sft peak memory {full_mem:.3f}: goal <= 1.05: {'met' if full_mem <= 1.05 else 'MISSED'}")
    print(f"posttrain: live/precomputed {live:.2f}, ours/anchor {anchor:.3f}, lora-dpo/lora-sft mem {lora_mem:.3f}, "
          f"dpo-precomputed/plain mem {full_mem:.3f}")


if __name__ == "__main__":
    main()
