"""`rayshard plan layout`: which layout rayshard would run on N ranks, and why."""
from __future__ import annotations

import argparse

from cluster.cli.plan import plan_subcommands
from plans.layout.chooser import Workload, choose_layout
from plans.training.model_spec import preset


def run_layout(args: argparse.Namespace) -> int:
    pinned = {name: getattr(args, name) for name in ("dp", "fsdp", "tp", "pp") if getattr(args, name)}
    choice = choose_layout(args.ranks, preset(args.model), Workload(args.global_batch, args.seq_len, args.microbatches),
                           args.memory_gib * 2 ** 30, ranks_per_node=args.ranks_per_node, pinned=pinned)
    print(choice.explain())
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    parser = plan_subcommands(commands).add_parser(
        "layout", help="choose dp/fsdp/tp/pp for a number of ranks and explain the choice",
        description="The layout elastic recovery would pick: constraints, memory estimate, least communication.")
    parser.add_argument("--ranks", type=int, required=True, metavar="N", help="ranks (GPUs) available")
    parser.add_argument("--model", default="small", metavar="PRESET", help="model preset (tiny, small, 405b)")
    parser.add_argument("--global-batch", type=int, default=16, metavar="N")
    parser.add_argument("--seq-len", type=int, default=256, metavar="N")
    parser.add_argument("--microbatches", type=int, default=1, metavar="N")
    parser.add_argument("--memory-gib", type=float, default=80.0, metavar="GIB", help="memory budget per rank")
    parser.add_argument("--ranks-per-node", type=int, default=8, metavar="N", help="tp stays within a node")
    for name in ("dp", "fsdp", "tp", "pp"):
        parser.add_argument(f"--{name}", type=int, metavar="N", help=f"pin {name}")
    parser.set_defaults(run_command=run_layout)
