"""The `rayshard` command line: one subcommand family per module, registered here."""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys

from plans.errors import RayshardError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rayshard",
        description="Ray-orchestrated distributed training with reshardable checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each family registers its own subcommands; importing lazily keeps `rayshard --help` fast.
    from cluster.cli import catalog as catalog_cli
    from cluster.cli import ckpt as ckpt_cli
    from cluster.cli import layout as layout_cli
    from cluster.cli import plan as plan_cli
    from cluster.cli import train as train_cli

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
    except BrokenPipeError:  # `rayshard ... | head`: the reader left; not an error of ours
        # Python would complain again flushing stdout at exit (as its docs advise, point it at devnull).
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except _storage_errors() as error:
        if os.environ.get("RAYSHARD_DEBUG") or _from_ray(error):
            raise  # Ray's errors (a failed task, a timeout) carry their own cause and traceback
        # s3fs turns S3 failures into OSError once its retries are spent; a user needs the object
        # and the reason, not a botocore traceback (which never holds credentials either way).
        print(f"rayshard: error: storage request failed: {type(error).__name__}: {_without_userinfo(_first_line(error))}. "
              "Fix: check the store URL, its credentials and endpoint (AWS_ENDPOINT_URL) and the network, then run "
              "the command again; nothing partial is visible (a checkpoint commits only with its manifest). "
              "RAYSHARD_DEBUG=1 shows the traceback", file=sys.stderr)
        return 3


def _from_ray(error: BaseException) -> bool:
    try:
        from ray.exceptions import RayError
    except ImportError:
        return False
    return isinstance(error, RayError)


def _without_userinfo(text: str) -> str:
    """An endpoint written as scheme://user:secret@host must not print its secret."""
    return re.sub(r"(://)[^@\s\"'<>]+@", r"\1***@", text)  # '/' too: secrets hold it unescaped


def _storage_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError,)
    try:
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        return errors
    return errors + (BotoCoreError, ClientError)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"


if __name__ == "__main__":
    sys.exit(main())
