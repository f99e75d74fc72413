"""Command groups (`rayshard plan ...`, `rayshard ckpt ...`) that several modules add to."""
from __future__ import annotations

import argparse


def command_group(commands: argparse._SubParsersAction, name: str, help: str, description: str) -> argparse._SubParsersAction:
    """The subparsers of `rayshard NAME`, created on first use and shared afterwards."""
    existing = commands.choices.get(name)
    if existing is not None:
        return existing.rayshard_subcommands
    parser = commands.add_parser(name, help=help, description=description)
    parser.rayshard_subcommands = parser.add_subparsers(dest=f"{name}_command", required=True, metavar=name.upper())
    return parser.rayshard_subcommands
