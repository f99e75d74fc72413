"""`rayshard data tokenizer train` and `rayshard data prepare`: tokenizers and prepared datasets."""
from __future__ import annotations

import argparse

from rayshard.cluster import progress
from rayshard.cluster.cli.groups import command_group
from rayshard.cluster.cli.arg_types import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE


def _input_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", nargs="+", required=True, metavar="URL",
                        help="text, JSONL (.jsonl) or Parquet (.parquet) files, directories or globs; any fsspec URL; "
                             "'stdlib' for this Python's standard library sources")
    parser.add_argument("--max-bytes", type=AT_LEAST_ONE, metavar="N", help="only the first input files, in order, up to N bytes")
    parser.add_argument("--field", default="text", metavar="NAME", help="the JSONL field holding each document (default text)")
    parser.add_argument("--column", default="text", metavar="NAME", help="the Parquet column holding each document (default text)")
    parser.add_argument("--skip-bad", action="store_true",
                        help="leave out bad input (non-UTF-8 text, empty files, missing fields, corrupt Parquet) and count it")


def register(commands: argparse._SubParsersAction) -> None:
    data = command_group(commands, "data", help="tokenizers and prepared (tokenized) datasets",
                         description="Train a tokenizer; tokenize corpora on Ray into token shards plus an index.")
    tokenizer = data.add_parser("tokenizer", help="tokenizers", description="Hugging Face tokenizers.")
    tokenizer_commands = tokenizer.add_subparsers(dest="tokenizer_command", required=True, metavar="TOKENIZER")
    train = tokenizer_commands.add_parser("train", help="train a byte-level BPE on your text (nothing is downloaded)",
                                          description="Train a byte-level BPE; writes tokenizer.json and tokenizer_config.json.")
    train.add_argument("--vocab-size", type=AT_LEAST_ONE, required=True, metavar="N")
    train.add_argument("--out", required=True, metavar="DIR", help="directory for tokenizer.json (an fsspec URL)")
    _input_arguments(train)
    progress.add_arguments(train)
    train.set_defaults(run_command="rayshard.cluster.cli.commands.data:run_tokenizer_train")

    prepare = data.add_parser("prepare", help="tokenize corpora on Ray into token shards plus a Parquet index",
                              description="Tokenize on Ray; write token shards and index.parquet (the commit) to --out.")
    prepare.add_argument("--tokenizer", required=True, metavar="DIR",
                         help="a tokenizer.json, a Hugging Face model directory, or a `data tokenizer train` --out")
    prepare.add_argument("--out", required=True, metavar="URL", help="where the dataset goes (a directory, s3://...)")
    prepare.add_argument("--cpus-per-task", type=NON_NEGATIVE, default=1.0, metavar="N", help="CPUs each tokenizing task asks Ray for")
    prepare.add_argument("--task-timeout", type=POSITIVE, default=600.0, metavar="SECONDS",
                         help="fail when no tokenizing task finishes within this")
    _input_arguments(prepare)
    prepare.add_argument("--format", choices=("text", "sft", "preference"), default="text",
                         help="text: documents packed for next-token loss (default); sft: one example per sample, "
                              "prompt/completion fields or a messages list, with loss masks on the completion; "
                              "preference: prompt/chosen/rejected rows for --objective dpo, two examples per pair")
    prepare.add_argument("--prompt-field", default="prompt", metavar="NAME",
                         help="--format sft/preference: the JSONL field or Parquet column of the prompt (default prompt; "
                              "under preference it may hold a messages list, rendered with the chat template)")
    prepare.add_argument("--completion-field", default="completion", metavar="NAME",
                         help="--format sft: the field or column of the completion (default completion)")
    prepare.add_argument("--messages-field", default="messages", metavar="NAME",
                         help="--format sft: a list of {role, content} rendered with the tokenizer's chat template; "
                              "the last (assistant) message is the completion (default messages)")
    prepare.add_argument("--chosen-field", default="chosen", metavar="NAME",
                         help="--format preference: the field or column of the preferred response (default chosen)")
    prepare.add_argument("--rejected-field", default="rejected", metavar="NAME",
                         help="--format preference: the field or column of the dispreferred response (default rejected)")
    prepare.add_argument("--max-tokens", type=AT_LEAST_ONE, metavar="N",
                         help="--format sft/preference: an example of more tokens is a bad row (refused, or counted under --skip-bad)")
    progress.add_arguments(prepare)
    prepare.set_defaults(run_command="rayshard.cluster.cli.commands.data:run_prepare")
    logprobs = data.add_parser("reference-logprobs", help="precompute a DPO reference's log-probabilities into a "
                               "preference dataset", description="Load the reference checkpoint on one rank actor and write "
                               "every example's summed response log-probability beside the dataset's index, keyed by "
                               "its index hash and the reference's digest; train with --dpo-precomputed.")
    logprobs.add_argument("--data", required=True, metavar="URL", help="the --out of `data prepare --format preference`")
    logprobs.add_argument("--from", dest="reference", required=True, metavar="CKPT",
                          help="the reference checkpoint: RUN@STEP, RUN or a URL (a LoRA run's base, not its adapters)")
    logprobs.add_argument("--store", default="./runs", metavar="URL", help="store holding the checkpoint (default ./runs)")
    logprobs.set_defaults(run_command="rayshard.cluster.cli.commands.data:run_reference_logprobs")
