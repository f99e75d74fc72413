"""Prepared data: tokenizing on Ray against plain `tokenizers`, and the loader's share of a step.

  prepare   `rayshard data prepare` (Ray Data map_batches over the files, shards + index committed) against a
            plain single-process loop over the same files: read, `Tokenizer.encode_batch` with
            TOKENIZERS_PARALLELISM=false (one core), ids to a uint16 array. Goal: ours / plain
            >= 0.8 x the CPUs Ray uses.
  loader    one rank training the `small` preset on the prepared dataset read from an S3 server
            (moto, 127.0.0.1): the time a step waits for its batch (prefetch on, and off) over the
            step's time. Goal < 2%.

    .venv/bin/python bench/data.py [--mib 8] [--vocab 4096] [--steps 8] [--repeat 3] [--skip-loader]
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import boto3  # noqa: E402
import fsspec  # noqa: E402
import numpy as np  # noqa: E402
import ray  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from rayshard.actors.training.data import stdlib_files  # noqa: E402
from rayshard.actors.training.trainer import Trainer  # noqa: E402
from bench.storage import start_s3_server  # noqa: E402
from rayshard.cluster.data.documents import ReadOptions  # noqa: E402
from rayshard.cluster.data.prepare import prepare_dataset  # noqa: E402
from rayshard.cluster.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer  # noqa: E402
from rayshard.storage import options as storage_options  # noqa: E402
from rayshard.plans.config import DataConfig, ModelChoice, TrainConfig  # noqa: E402


def corpus_files(mib: float) -> list[str]:
    files, total = [], 0
    for path in stdlib_files():
        files.append(path)
        total += os.path.getsize(path)
        if total >= mib * 2**20:
            break
    return files


def plain_tokens_per_s(files: list[str], tokenizer_json: str) -> tuple[int, float]:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    started = time.perf_counter()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    tokens = 0
    for first in range(0, len(files), 256):
        texts = [open(path, encoding="utf-8", errors="replace").read() for path in files[first:first + 256]]
        for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
            tokens += len(np.asarray(encoding.ids + [0], dtype=np.uint16))
    return tokens, time.perf_counter() - started


def loader_share(dataset_url: str, vocab: int, steps: int, prefetch: int) -> tuple[float, float]:
    """(median seconds a step waited for its batch, median step seconds) on one rank."""
    config = TrainConfig(model=ModelChoice.named("small", vocab_size=vocab), global_batch=8, seq_len=256,
                         steps=steps, data=DataConfig(dataset=dataset_url, prefetch_steps=prefetch)).validate()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    trainer = Trainer(config, 0, f"tcp://127.0.0.1:{port}")
    waits: list[float] = []
    fetch = trainer.data.rank_batch

    def timed(*args):
        started = time.perf_counter()
        batch = fetch(*args)
        waits.append(time.perf_counter() - started)
        return batch

    trainer.data.rank_batch = timed
    step_seconds = []
    try:
        for _ in range(steps):
            started = time.perf_counter()
            trainer.train_step()
            step_seconds.append(time.perf_counter() - started)
    finally:
        trainer.shutdown()
    # The first step opens the index and warms up; medians of the rest.
    return float(np.median(waits[1:])), float(np.median(step_seconds[1:]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=8.0, help="MiB of standard-library sources to tokenize")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3, help="prepare runs (each against its own plain run); medians")
    parser.add_argument("--skip-loader", action="store_true", help="measure prepare only")
    args = parser.parse_args()
    files = corpus_files(args.mib)
    work = tempfile.mkdtemp(prefix="rayshard-bench-data-")
    started = time.perf_counter()
    tokenizer = train_tokenizer(files[: max(1, len(files) // 4)], args.vocab, ReadOptions(skip_bad=True))
    save_tokenizer(tokenizer, f"{work}/tok")
    tokenizer = load_tokenizer(f"{work}/tok")
    print(f"tokenizer: {tokenizer.vocab_size} ids trained in {time.perf_counter() - started:.1f}s on a quarter of "
          f"{len(files)} files ({sum(os.path.getsize(f) for f in files) / 2**20:.1f} MiB)")

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    cpus = int(ray.cluster_resources()["CPU"])
    # Plain and ours alternate, so a load that comes and goes on a shared machine falls on both.
    plain_rates, our_rates = [], []
    for attempt in range(args.repeat):
        plain_tokens, plain_s = plain_tokens_per_s(files, tokenizer.json_text)
        summary = prepare_dataset(files, tokenizer, f"{work}/ds-{attempt}", ReadOptions(skip_bad=True), log=lambda _: None)
        plain_rates.append(plain_tokens / plain_s)
        our_rates.append(summary.tokens / summary.seconds)
        print(f"  run {attempt + 1}: plain {plain_rates[-1]:,.0f} tokens/s, ours {our_rates[-1]:,.0f} tokens/s "
              f"-> {our_rates[-1] / plain_rates[-1]:.2f}")
    ours, plain = float(np.median(our_rates)), float(np.median(plain_rates))
    ratios = sorted(o / p for o, p in zip(our_rates, plain_rates))
    print(f"prepare (medians of {args.repeat}): plain {plain:,.0f} tokens/s ({plain_tokens:,} tokens, 1 core); ours "
          f"{ours:,.0f} tokens/s ({summary.tokens:,} tokens, {cpus} CPUs, Ray Data, {len(summary.skipped)} skipped) "
          f"-> ours/plain {ours / plain:.2f} (per run {', '.join(f'{r:.2f}' for r in ratios)}; goal >= {0.8 * cpus:.1f})")
    ray.shutdown()
    if args.skip_loader:
        return 0
    os.rename(f"{work}/ds-0", f"{work}/ds")

    server, endpoint = start_s3_server()
    try:
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_ENDPOINT_URL": endpoint})
        storage_options.configure()
        boto3.client("s3").create_bucket(Bucket="bench-data")
        fs = fsspec.filesystem("s3")
        local = fsspec.filesystem("file")
        for path in local.find(f"{work}/ds"):
            fs.pipe_file(f"bench-data/ds/{path[len(work) + 4:]}", local.cat_file(path))
        for prefetch in (4, 0):
            waited, step = loader_share("s3://bench-data/ds", tokenizer.vocab_size + (-tokenizer.vocab_size) % 8,
                                        args.steps, prefetch)
            print(f"loader (small preset, 1 rank, S3 at {endpoint}, prefetch {prefetch}): waited {waited * 1e3:.2f} ms "
                  f"of a {step * 1e3:.0f} ms step -> {100 * waited / step:.2f}% (goal < 2%)")
    finally:
        server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
