"""`rayshard data ...`: what the data parsers (cluster/cli/data.py) run."""
from __future__ import annotations

import argparse
import sys

from rayshard.cluster.data.documents import ReadOptions
from rayshard.cluster.data.prepare import prepare_dataset
from rayshard.cluster.run.reference_logprobs import compute_reference_logprobs
from rayshard.cluster.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from rayshard.cluster.progress import byte_bar
from rayshard.cluster.ray_connection import connect_ray
from rayshard.storage import options as storage_options


def _read_options(args: argparse.Namespace) -> ReadOptions:
    sft = dict(format=args.format, prompt_field=args.prompt_field, completion_field=args.completion_field,
               messages_field=args.messages_field, max_tokens=args.max_tokens,
               chosen_field=args.chosen_field, rejected_field=args.rejected_field) if hasattr(args, "format") else {}
    return ReadOptions(field=args.field, column=args.column, skip_bad=args.skip_bad, max_bytes=args.max_bytes, **sft)


def run_tokenizer_train(args: argparse.Namespace) -> int:
    storage_options.configure()
    with byte_bar(args, "text read") as bar:
        loaded = train_tokenizer(args.input, args.vocab_size, _read_options(args), progress=bar)
    save_tokenizer(loaded, args.out)
    print(f"tokenizer: {loaded.vocab_size} ids (end of document {loaded.eos_token!r} = {loaded.eos_id}), "
          f"hash {loaded.hash}, written to {args.out}")
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    storage_options.configure()
    tokenizer = load_tokenizer(args.tokenizer)
    connect_ray()
    with byte_bar(args, "tokenized") as bar:
        summary = prepare_dataset(args.input, tokenizer, args.out, _read_options(args), args.cpus_per_task,
                                  args.task_timeout, progress=bar)
    for line in summary.skipped:
        print(f"skipped: {line}", file=sys.stderr)
    print(summary.line())
    return 0


def run_reference_logprobs(args: argparse.Namespace) -> int:
    storage_options.configure()
    compute_reference_logprobs(args.data, args.reference, args.store)
    return 0
