"""`rayshard ckpt ...`: inspect checkpoints. Other modules add subcommands to the same group."""
from __future__ import annotations

import argparse
import json

from cluster.cli_groups import command_group


def ckpt_subcommands(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:
    return command_group(commands, "ckpt", help="inspect, verify, reshard and convert checkpoints",
                         description="Checkpoints are addressed as RUN[@STEP] within --store, or by URL.")


def add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CKPT", help="RUN[@STEP] within --store, or a checkpoint directory URL")
    parser.add_argument("--store", default="./runs", metavar="URL", help="store holding the run (default ./runs)")


def resolve_checkpoint(args: argparse.Namespace):
    from cluster.store import Store

    return Store(args.store).resolve(args.checkpoint)


def run_show(args: argparse.Namespace) -> int:
    from actors.checkpointing import read_manifest

    ref = resolve_checkpoint(args)
    chunks, metadata = read_manifest(ref.url)
    tensors = {(c.name, c.kind) for c in chunks}
    files = {c.file for c in chunks}
    total = sum(c.byte_end - c.byte_start for c in chunks)
    print(f"checkpoint {ref.url}")
    print(f"  run {metadata.get('run')} step {metadata.get('step')}  format {metadata.get('format_version')}")
    print(f"  layout {metadata.get('layout')}  model {metadata.get('model_preset')}")
    print(f"  {len(tensors)} tensors (params and optimizer moments), {len(chunks)} chunks in {len(files)} files, "
          f"{total / 2**20:.2f} MiB")
    print(f"  parent {metadata.get('parent')}")
    if args.json:
        print(json.dumps(metadata, indent=2, sort_keys=True, default=str))
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    show = ckpt_subcommands(commands).add_parser("show", help="a checkpoint's metadata and size")
    add_checkpoint_argument(show)
    show.add_argument("--json", action="store_true", help="also print the full metadata as JSON")
    show.set_defaults(run_command=run_show)
