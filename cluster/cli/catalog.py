"""`rayshard ckpt ls | verify | gc`: the catalog of a store, from the command line."""
from __future__ import annotations

import argparse

from rayshard.cluster import progress
from rayshard.cluster.cli.ckpt import add_checkpoint_argument, ckpt_subcommands
from rayshard.cluster.cli.arg_types import AT_LEAST_ZERO, NON_NEGATIVE, run_name


def register(commands: argparse._SubParsersAction) -> None:
    group = ckpt_subcommands(commands)
    ls = group.add_parser("ls", help="runs and their checkpoints: step, layout, size, status, parent",
                          description="List the whole checkpoints of a store (a crashed save never shows up here).")
    ls.add_argument("--store", default="./runs", metavar="URL", help="store URL (default ./runs)")
    ls.add_argument("--run", type=run_name, metavar="NAME", help="only this run")
    ls.add_argument("--all", action="store_true", help="also list leftovers of failed or running saves")
    ls.add_argument("--json", action="store_true", help="one JSON record per checkpoint")
    ls.set_defaults(run_command="rayshard.cluster.cli.commands.catalog:run_ls")

    verify = group.add_parser("verify", help="check that a checkpoint's files exist with their sizes (--deep: checksums)")
    add_checkpoint_argument(verify)
    verify.add_argument("--deep", action="store_true", help="read every chunk back and compare its CRC32")
    progress.add_arguments(verify)
    verify.set_defaults(run_command="rayshard.cluster.cli.commands.catalog:run_verify")

    gc = group.add_parser("gc", help="keep the newest N whole checkpoints per run; remove the rest and leftovers",
                          description="Never removes a run's newest whole checkpoint, LATEST, checkpoints being read, a "
                                      "damaged checkpoint with no whole one newer, or anything written within --grace. "
                                      "Prints each checkpoint with the rule that keeps or removes it (--dry-run: removes nothing).")
    gc.add_argument("--keep", type=AT_LEAST_ZERO, required=True, metavar="N",
                    help="whole checkpoints to keep per run (the newest whole one always stays, and LATEST; damaged ones never count)")
    gc.add_argument("--store", default="./runs", metavar="URL", help="store URL (default ./runs)")
    gc.add_argument("--run", type=run_name, metavar="NAME", help="only this run")
    gc.add_argument("--grace", type=NON_NEGATIVE, default=3600.0, metavar="SECONDS",
                    help="leave leftovers and uploads younger than this alone (default 3600: saves in progress)")
    gc.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    gc.set_defaults(run_command="rayshard.cluster.cli.commands.catalog:run_gc")
