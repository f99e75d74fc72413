"""`rayshard plan ...`: pipeline schedules and stage placement, from the terminal.

    rayshard plan schedule --schedule zbh1 --pp 4 --microbatches 8 [--vpp 2]
                           [--costs F=1,B=2,W=1] [--comm async|rendezvous] [--png out.png]
    rayshard plan schedule --costs-from RUN [--store URL] [--schedule ...]   (measured costs)
    rayshard plan compare  --pp 4 --microbatches 8 [--vpp 2] [--costs ...]
    rayshard plan layers   --layers 30 --pp 4 [--vpp 2] [--schedule ...] [--layout 8,7,7,8]

Other modules add their own `plan` subcommands through `plan_subcommands(commands)`.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from rayshard.plans.pipeline.schedules import SPECS
from rayshard.cluster.cli.groups import command_group
from rayshard.cluster.cli.arg_types import LAYERS, MICROBATCHES, NON_NEGATIVE, PIPELINE_RANKS, STAGES_PER_RANK, png_path

SCHEDULE_NAMES = list(SPECS) + ["i1f1b"]
DEFAULT_COSTS = "F=1,B=2,W=1"


def plan_subcommands(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """The subparsers of `rayshard plan`, created on first use; any module may add to them."""
    return command_group(commands, "plan", help="pipeline schedules, stage placement and other plans (no cluster needed)",
                         description="Build, check, simulate and draw plans without starting anything.")


def register(commands: argparse._SubParsersAction) -> None:
    subcommands = plan_subcommands(commands)

    schedule = subcommands.add_parser(
        "schedule", help="check, simulate and draw one pipeline schedule",
        description="Build a schedule, lower it with send/recv, check it for deadlocks and "
        "dependencies, simulate time and activation memory, and print (or draw) it.",
    )
    schedule.add_argument("--schedule", choices=SCHEDULE_NAMES, metavar="NAME",
                          help="one of: " + ", ".join(SCHEDULE_NAMES) + " (default with --costs-from: the run's)")
    _add_shape_arguments(schedule, shape_from_run=True)
    schedule.add_argument("--costs-from", metavar="RUN",
                          help="simulate with the per-action times a pipeline training run measured: a run name "
                          "in --store, a run directory, or a pipeline_timings.json file; --schedule, --pp and "
                          "--microbatches default to the run's")
    schedule.add_argument("--store", default="./runs", metavar="URL", help="where --costs-from finds runs (default ./runs)")
    schedule.add_argument("--from-csv", type=Path, metavar="FILE",
                          help="a pipeline order in torch.distributed.pipelining's CSV format (one row per rank) "
                               "instead of --schedule")
    schedule.add_argument("--png", type=lambda text: Path(png_path(text)), help="also draw a Gantt chart into this PNG file")
    schedule.add_argument("--json", type=Path, help="also write the lowered per-rank action lists as JSON")
    schedule.add_argument("--no-grid", action="store_true", help="skip the text grid")
    schedule.set_defaults(run_command="rayshard.cluster.cli.commands.plan:run_schedule")

    compare = subcommands.add_parser(
        "compare", help="simulate every schedule on the same pipeline, side by side",
        description="Every schedule on the same pp, microbatches and costs; --vpp applies to "
        "interleaved 1F1B (ZB-V and DualPipeV always run 2 stages per rank).",
    )
    _add_shape_arguments(compare)
    compare.set_defaults(run_command="rayshard.cluster.cli.commands.plan:run_compare")

    layers = subcommands.add_parser(
        "layers", help="which layers go on which stage and rank",
        description="Cut the model's layers into pp x vpp stages (balanced by cost unless "
        "--layout is given) and place the stages on ranks as the schedule needs.",
    )
    layers.add_argument("--layers", type=LAYERS, required=True, help="number of transformer layers")
    layers.add_argument("--pp", type=PIPELINE_RANKS, required=True, help="pipeline ranks")
    layers.add_argument("--vpp", type=STAGES_PER_RANK, help="stages per rank (default: the schedule's, else 1)")
    layers.add_argument("--schedule", choices=SCHEDULE_NAMES, metavar="NAME",
                        help="placement follows the schedule: looped for interleaved1f1b, V for zbv/dualpipev")
    layers.add_argument("--layer-costs", help="comma-separated cost per layer (default 1 each)")
    layers.add_argument("--embedding-cost", type=NON_NEGATIVE, default=0.0, help="cost of the embedding, on stage 0")
    layers.add_argument("--head-cost", type=NON_NEGATIVE, default=0.0, help="cost of the LM head, on the last stage")
    layers.add_argument("--layout", help='explicit cut: layer counts per stage "8,7,7,8" or ranges "0-7,8-14,15-21,22-29"')
    layers.set_defaults(run_command="rayshard.cluster.cli.commands.plan:run_layers")


def _add_shape_arguments(parser: argparse.ArgumentParser, shape_from_run: bool = False) -> None:
    parser.add_argument("--pp", type=PIPELINE_RANKS, required=not shape_from_run, help="pipeline ranks")
    parser.add_argument("--microbatches", "-m", type=MICROBATCHES, required=not shape_from_run, help="microbatches per step")
    parser.add_argument("--vpp", type=STAGES_PER_RANK, help="stages per rank (interleaved only; default 2 there, else fixed)")
    parser.add_argument("--costs", default=DEFAULT_COSTS,
                        help="time of one rank's share of the model: F, B (= I + W), I, W, C (one "
                        f"transfer), overlap (FB); default {DEFAULT_COSTS}")
    parser.add_argument("--comm", choices=["async", "rendezvous"], default="async",
                        help="transfers as isend/irecv (async, default) or blocking rendezvous")
