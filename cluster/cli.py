"""The `rayshard` command line: one subcommand family per module, registered here."""
from __future__ import annotations

import argparse
import sys

from plans.errors import RayshardError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayshard",
        description="Ray-orchestrated distributed training with reshardable checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each family registers its own subcommands; importing lazily keeps `rayshard --help` fast.
    from cluster import catalog_cli, ckpt_cli, layout_cli, plan_cli, train_cli

    for module in (train_cli, plan_cli, layout_cli, ckpt_cli, catalog_cli):
        module.register(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run_command(args) or 0)
    except RayshardError as error:
        print(f"rayshard: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
