"""`rayshard plan layout`: which layout rayshard would run on N ranks, and why."""
from __future__ import annotations

import argparse

from rayshard.cluster.cli.plan import plan_subcommands
from rayshard.cluster.cli.arg_types import AT_LEAST_ONE, POSITIVE
from rayshard.cluster.cli.config_flags import add_flag
from rayshard.plans.config import CheckpointConfig, ModelChoice, NumericsConfig, PipelineConfig, TrainConfig
from rayshard.plans.layout.chooser import PINNABLE_DEGREES
from rayshard.plans.layout.parallel_layout import ParallelLayout


def register(commands: argparse._SubParsersAction) -> None:
    parser = plan_subcommands(commands).add_parser(
        "layout", help="choose dp/fsdp/tp/pp (and an MoE model's ep) for a number of ranks and explain the choice",
        description="The layout elastic recovery would pick: constraints, memory estimate, least communication.")
    parser.add_argument("--ranks", type=AT_LEAST_ONE, required=True, metavar="N", help="ranks (GPUs) available")
    # The flags it shares with `train` come from the same config fields (names, metavars, choices);
    # with no config to validate them, the counts are range-checked while parsed, and each has a default.
    add_flag(parser, ModelChoice, "preset", default="small",
             help="model preset (tiny, small, moe-tiny, moe-small, 405b)")
    add_flag(parser, TrainConfig, "global_batch", type=AT_LEAST_ONE, default=16)
    add_flag(parser, TrainConfig, "seq_len", type=AT_LEAST_ONE, default=256)
    add_flag(parser, PipelineConfig, "microbatches", type=AT_LEAST_ONE, default=1)
    parser.add_argument("--memory-gib", type=POSITIVE, default=80.0, metavar="GIB", help="memory budget per rank")
    parser.add_argument("--ranks-per-node", type=AT_LEAST_ONE, default=8, metavar="N", help="tp stays within a node")
    add_flag(parser, NumericsConfig, "precision", default="fp32",
             help="the memory estimate's compute dtype (master state is float32 either way)")
    add_flag(parser, NumericsConfig, "ac", default="none", help="the activation checkpointing the memory estimate assumes")
    add_flag(parser, CheckpointConfig, "snapshot_every", default=0,
             help="K > 0: also say how much host memory snapshots in memory take per rank (besides the GPU budget)")
    for name in PINNABLE_DEGREES:
        add_flag(parser, ParallelLayout, name, type=AT_LEAST_ONE, help=f"pin {name}" + (
            " (1 or fsdp; an MoE model otherwise gets ep = fsdp where fsdp divides its experts)" if name == "ep" else ""))
    parser.set_defaults(run_command="rayshard.cluster.cli.commands.layout:run_layout")
