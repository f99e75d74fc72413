"""`rayshard plan layout`: which layout rayshard would run on N ranks, and why."""
from __future__ import annotations

import argparse

from rayshard.cluster.cli.plan import plan_subcommands
from rayshard.cluster.cli.arg_types import AT_LEAST_ONE, POSITIVE
from rayshard.plans.layout.chooser import PINNABLE_DEGREES


def register(commands: argparse._SubParsersAction) -> None:
    parser = plan_subcommands(commands).add_parser(
        "layout", help="choose dp/fsdp/tp/pp (and an MoE model's ep) for a number of ranks and explain the choice",
        description="The layout elastic recovery would pick: constraints, memory estimate, least communication.")
    parser.add_argument("--ranks", type=AT_LEAST_ONE, required=True, metavar="N", help="ranks (GPUs) available")
    parser.add_argument("--model", default="small", metavar="PRESET", help="model preset (tiny, small, moe-tiny, moe-small, 405b)")
    parser.add_argument("--global-batch", type=AT_LEAST_ONE, default=16, metavar="N")
    parser.add_argument("--seq-len", type=AT_LEAST_ONE, default=256, metavar="N")
    parser.add_argument("--microbatches", type=AT_LEAST_ONE, default=1, metavar="N")
    parser.add_argument("--memory-gib", type=POSITIVE, default=80.0, metavar="GIB", help="memory budget per rank")
    parser.add_argument("--ranks-per-node", type=AT_LEAST_ONE, default=8, metavar="N", help="tp stays within a node")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                        help="the memory estimate's compute dtype (master state is float32 either way)")
    parser.add_argument("--ac", choices=("none", "full", "selective"), default="none",
                        help="the activation checkpointing the memory estimate assumes")
    for name in PINNABLE_DEGREES:
        parser.add_argument(f"--{name}", type=AT_LEAST_ONE, metavar="N", help=f"pin {name}" + (
            " (1 or fsdp; an MoE model otherwise gets ep = fsdp where fsdp divides its experts)" if name == "ep" else ""))
    parser.set_defaults(run_command="rayshard.cluster.cli.commands.layout:run_layout")
