"""`rayshard train`: a config file from configs/ plus command-line overrides."""
from __future__ import annotations

import argparse
import os
import sys

import yaml

from plans.config import TrainConfig, with_overrides
from plans.errors import ConfigError
from plans.pipeline.schedules import schedule_spec

# cluster/cli/train.py -> the repository root, where configs/ lives.
DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs", "demo.yaml")

# CLI flag -> dotted config field. Flags not given leave the file's value alone.
OVERRIDES = {
    "model": "model_preset", "run": "run", "store": "store", "steps": "steps", "ckpt_every": "ckpt_every",
    "resume": "resume", "global_batch": "global_batch", "seq_len": "seq_len", "microbatches": "microbatches",
    "seed": "seed", "schedule": "schedule", "world_size": "world_size", "lr": "optimizer.lr",
    "warmup_steps": "optimizer.warmup_steps", "data": "data.source",
    "dp": "layout.dp", "fsdp": "layout.fsdp", "tp": "layout.tp", "pp": "layout.pp", "vpp": "layout.vpp",
    "stage_layout": "stage_layout", "pipeline_timeout": "pipeline_timeout_s",
    "verify_resume": "verify_resume",
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help=f"YAML config (default: configs/demo.yaml embedded defaults)")
    parser.add_argument("--model", metavar="PRESET", help="model preset: tiny | small")
    parser.add_argument("--run", metavar="NAME", help="run name within the store")
    parser.add_argument("--store", metavar="URL", help="store URL: a directory, file://, s3://bucket/prefix, memory://")
    for name in ("dp", "fsdp", "tp", "pp", "vpp"):
        parser.add_argument(f"--{name}", type=int, metavar="N", help=f"{name} degree")
    parser.add_argument("--world-size", type=int, metavar="N", help="optional check: must equal dp*fsdp*tp*pp")
    parser.add_argument("--steps", type=int, metavar="N", help="train until this many steps are done")
    parser.add_argument("--ckpt-every", type=int, metavar="N", help="commit a checkpoint every N steps (0: at the end only)")
    parser.add_argument("--resume", metavar="CKPT", help="latest | auto (latest if the run has checkpoints, else start fresh) | RUN | RUN@STEP | checkpoint URL")
    parser.add_argument("--async-save", action="store_true",
                        help="checkpoints block training only while ranks copy state to CPU; uploads run in the background")
    parser.add_argument("--verify-resume", action="store_true", default=None,
                        help="after resuming, prove the loaded state's digests equal the checkpoint's (one extra save)")
    parser.add_argument("--global-batch", type=int, metavar="N", help="sequences per step over all data ranks")
    parser.add_argument("--seq-len", type=int, metavar="N", help="tokens per sequence")
    parser.add_argument("--microbatches", type=int, metavar="N", help="gradient accumulation / pipeline microbatches")
    parser.add_argument("--schedule", metavar="NAME",
                        help="pipeline schedule with --pp > 1: gpipe, 1f1b, interleaved1f1b, zbh1, zbv, dualpipev "
                        "(--vpp defaults to the schedule's: 2 for interleaved1f1b, zbv and dualpipev)")
    parser.add_argument("--stage-layout", type=_layer_counts, metavar="N,N,..",
                        help="layers per pipeline stage (pp x vpp counts), e.g. 1,3; default: an even cut")
    parser.add_argument("--pipeline-timeout", type=float, metavar="SECONDS",
                        help="fail a pipeline step whose transfer waits longer than this (default: the collective timeout)")
    parser.add_argument("--seed", type=int, metavar="N")
    parser.add_argument("--lr", type=float, metavar="LR", help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, metavar="N")
    parser.add_argument("--data", metavar="SOURCE", help="'stdlib', a file, directory, glob or fsspec URL")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    path = args.config or DEFAULT_CONFIG
    try:
        with open(path) as handle:
            data = yaml.safe_load(handle) or {}
    except FileNotFoundError:
        raise ConfigError("--config", path, "file not found", "pass an existing YAML file, e.g. configs/demo.yaml") from None
    if not isinstance(data, dict):
        raise ConfigError("--config", path, "the file must hold a YAML mapping", "see configs/demo.yaml for the shape")
    if args.model:  # a preset on the command line replaces the file's model section entirely
        data["model"] = {"preset": args.model}
    config = TrainConfig.from_dict(data)
    overrides = {field: getattr(args, flag) for flag, field in OVERRIDES.items() if flag != "model"}
    file_layout = data.get("layout") or {}
    pipelined = (args.pp if args.pp is not None else file_layout.get("pp", 1)) > 1
    if pipelined and args.schedule and args.vpp is None and "vpp" not in file_layout:
        # The schedule fixes how many stages a rank runs; don't make the user repeat it.
        overrides["layout.vpp"] = schedule_spec(args.schedule).default_vpp
    return with_overrides(config, **overrides).validate()


def _layer_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated layer counts, e.g. 1,3") from None


def run_train(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.elastic:
        return _run_elastic(args, config)
    from cluster.run.rank_group import StepFailed
    from cluster.run.train import train  # imports Ray and torch; keep `--help` fast

    try:
        result = train(config, async_save=getattr(args, "async_save", False))
    except StepFailed as failed:  # each rank's own error says where it stopped; a traceback adds nothing
        print(f"rayshard: training stopped: {failed}", file=sys.stderr)
        return 1
    if result.checkpoints:
        print(f"latest checkpoint: {result.checkpoints[-1]}")
    return 0


def _run_elastic(args: argparse.Namespace, config) -> int:
    from cluster.run.controller import State
    from cluster.run.elastic import train_elastic
    from plans.elastic import FailurePolicy, ScalingPolicy

    # Dimensions given on the command line are pins; the chooser picks the rest for each attempt.
    pinned = {name: getattr(args, name) for name in ("dp", "fsdp", "tp", "pp") if getattr(args, name)}
    controller, state = train_elastic(
        config, pinned, ScalingPolicy(args.min_ranks, args.max_ranks),
        FailurePolicy(max_failures=args.max_failures, backoff_s=args.backoff_s),
        memory_per_rank_bytes=args.memory_gib * 2**30, cpus_per_rank=args.cpus_per_rank)
    if state is State.ERRORED:
        print(f"rayshard: error: elastic training stopped: {controller.history[-1].detail}")
        return 1
    return 0


def register(commands) -> None:
    parser = commands.add_parser("train", help="train a model on Ray rank actors",
                                 description="Train on Ray: one actor per rank, DP/FSDP x TP x PP, checkpoints to --store.")
    add_config_arguments(parser)
    elastic = parser.add_argument_group("elastic training (survive rank failures and topology changes)")
    elastic.add_argument("--elastic", action="store_true",
                         help="choose the layout from the ranks available; on failure or growth, resume from LATEST on a new layout")
    elastic.add_argument("--min-ranks", type=int, default=1, metavar="N")
    elastic.add_argument("--max-ranks", type=int, default=None, metavar="N")
    elastic.add_argument("--max-failures", type=int, default=3, metavar="N")
    elastic.add_argument("--backoff-s", type=float, default=1.0, metavar="S", help="first restart delay (doubles)")
    elastic.add_argument("--memory-gib", type=float, default=64.0, metavar="GIB", help="memory budget per rank")
    elastic.add_argument("--cpus-per-rank", type=float, default=1.0, metavar="N", help="on CPU clusters: CPUs per rank")
    parser.set_defaults(run_command=run_train)
