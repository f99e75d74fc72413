"""`rayshard train`: a config file from configs/ plus command-line overrides."""
from __future__ import annotations

import argparse
from importlib.resources import files

from rayshard.cluster.cli.arg_types import AT_LEAST_ONE, AT_LEAST_ZERO, NON_NEGATIVE, POSITIVE, layer_counts
from rayshard.plans.layout.parallel_layout import LAYOUT_DEGREES

# configs/ ships as package data (rayshard.configs): found the same way in a checkout, an editable
# install and a wheel.
DEFAULT_CONFIG = str(files("rayshard.configs") / "demo.yaml")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="YAML config (default: configs/demo.yaml embedded defaults)")
    parser.add_argument("--model", metavar="PRESET", help="model preset: tiny | small")
    parser.add_argument("--model-factory", metavar="PACKAGE.MODULE:FUNCTION",
                        help="your own model: a function returning the module and its plan "
                             "(e.g. examples.gpt2.model:tiny_gpt2; README, 'Bring your own model')")
    parser.add_argument("--run", metavar="NAME", help="run name within the store")
    parser.add_argument("--store", metavar="URL", help="store URL: a directory, file://, s3://bucket/prefix, memory://")
    for name in LAYOUT_DEGREES:
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
    parser.add_argument("--stage-layout", type=layer_counts, metavar="N,N,..",
                        help="layers per pipeline stage (pp x vpp counts), e.g. 1,3; default: an even cut")
    parser.add_argument("--schedule-csv", metavar="FILE",
                        help="run a pipeline order from a file (torch.distributed.pipelining's CSV: one row per rank) "
                             "instead of --schedule; --pp, --vpp and --microbatches default to the file's")
    parser.add_argument("--pipeline-timeout", type=float, metavar="SECONDS",
                        help="fail a pipeline step whose transfer waits longer than this (default: the collective timeout)")
    parser.add_argument("--cpus-per-rank", type=float, metavar="N",
                        help="CPUs each rank asks Ray for (default: an equal share of the cluster's CPUs, at most 1)")
    parser.add_argument("--gpus-per-rank", type=float, metavar="N",
                        help="GPUs each rank asks Ray for (default: 1 where the cluster has GPUs, else 0: CPU ranks)")
    parser.add_argument("--start-timeout", type=float, metavar="SECONDS",
                        help="fail when the ranks' resources are not granted, or their actors not alive, within this "
                             "(default 60; each start-up wait has this bound)")
    parser.add_argument("--call-timeout", type=float, metavar="SECONDS",
                        help="fail a step, load or save that some rank has not answered within this (default 3600)")
    parser.add_argument("--seed", type=int, metavar="N")
    parser.add_argument("--lr", type=float, metavar="LR", help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, metavar="N")
    parser.add_argument("--data", metavar="SOURCE", help="'stdlib', a file, directory, glob or fsspec URL; a prepared dataset's URL; "
                        "or weighted datasets, URL=0.7,URL=0.3")
    speed = parser.add_argument_group("precision and speed")
    speed.add_argument("--precision", choices=("fp32", "bf16"),
                       help="bf16: bf16 compute with float32 master weights, moments and gradient reduction (default fp32)")
    speed.add_argument("--ac", choices=("none", "full", "selective"),
                       help="activation checkpointing per transformer block; selective keeps matmul outputs (default none)")
    speed.add_argument("--compile", action="store_true", default=None, help="torch.compile each transformer block")
    speed.add_argument("--sp", action="store_true", default=None,
                       help="sequence parallelism with --tp: norms and the residual stream split over the sequence")
    speed.add_argument("--tensorboard", action="store_true", default=None,
                       help="write TensorBoard event files under the run directory (tensorboard/)")
    speed.add_argument("--wandb-project", metavar="NAME", help="also log step metrics to Weights & Biases (needs wandb)")


def register(commands) -> None:
    parser = commands.add_parser("train", help="train a model on Ray rank actors",
                                 description="Train on Ray: one actor per rank, DP/FSDP x TP x PP, checkpoints to --store.")
    add_config_arguments(parser)
    elastic = parser.add_argument_group("elastic training (survive rank failures and topology changes)")
    elastic.add_argument("--elastic", action="store_true",
                         help="choose the layout from the ranks available; on failure or growth, resume from LATEST on a new layout")
    elastic.add_argument("--min-ranks", type=AT_LEAST_ONE, default=1, metavar="N")
    elastic.add_argument("--max-ranks", type=AT_LEAST_ONE, default=None, metavar="N")
    elastic.add_argument("--max-failures", type=AT_LEAST_ZERO, default=3, metavar="N")
    elastic.add_argument("--backoff-s", type=NON_NEGATIVE, default=1.0, metavar="S", help="first restart delay (doubles)")
    elastic.add_argument("--memory-gib", type=POSITIVE, default=64.0, metavar="GIB", help="memory budget per rank")
    parser.set_defaults(run_command="rayshard.cluster.cli.commands.train:run_train")
