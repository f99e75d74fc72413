"""The `rayshard` command line: one subcommand family per module, registered here.

The parser modules (cluster/cli/*.py) import no torch and no Ray; each subcommand names what it
runs as "module:function" in cluster/cli/commands/, and `main` imports that module only when the
subcommand runs. This is the one place rayshard defers an import: `rayshard --help`, `ckpt ls` and
`ckpt show` stay light (no torch), while `train` pulls in Ray and torch.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import linecache
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from rayshard.cluster.cli import catalog as catalog_cli
from rayshard.cluster.cli import ckpt as ckpt_cli
from rayshard.cluster.cli import data as data_cli
from rayshard.cluster.cli import layout as layout_cli
from rayshard.cluster.cli import plan as plan_cli
from rayshard.cluster.cli import train as train_cli
from rayshard.cluster.cli.redacted_output import redacted_output
from rayshard.plans.errors import RayshardError, StepFailed, StoreUnavailable, from_rank, rank_of


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments end in one line naming the argument, what is wrong and where the usage is,
    like every other input error (argparse's default adds its usage lines first); subcommand
    parsers are made of the same class."""

    def error(self, message: str):
        self.exit(2, f"rayshard: error: {self.prog}: {message}. Fix: see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="rayshard",
        description="Ray-orchestrated distributed training with reshardable checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (train_cli, plan_cli, layout_cli, ckpt_cli, catalog_cli, data_cli):
        module.register(commands)
    return parser


def command_of(args: argparse.Namespace) -> Callable[[argparse.Namespace], int | None]:
    """The function a parsed command line runs: its "module:function" name imported now."""
    command = args.run_command
    if isinstance(command, str):
        module, _, function = command.partition(":")
        command = getattr(importlib.import_module(module), function)
    return command


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    with redacted_output(argv):  # every line printed from here on, the arguments' own errors too
        return _run(build_parser(), argv)


def _run(parser: argparse.ArgumentParser, argv: list[str]) -> int:
    args = parser.parse_args(argv)
    try:
        return int(command_of(args)(args) or 0)
    except StepFailed as failed:
        # A rank's own error of the user's making reads as if the driver had raised it.
        first = failed.first_cause((RayshardError,) + _storage_errors())
        if first is not None:
            rank, cause = first
            return _report(from_rank(cause, rank, failed.tracebacks.get(rank, "")))
        if failed.dead_ranks:  # a process killed (OOM, a lost node): the cluster's doing, not a bug of ours
            others = len(failed.failures) - 1 + len(failed.silent)
            print(f"rayshard: error: training stopped: rank {failed.dead_ranks[0]}'s process died during "
                  f"{failed.method}" + (f" ({others} other rank(s) stopped with it)" if others else "")
                  + ". Fix: resubmit with --resume auto, or train with --elastic to recover by itself; the last "
                  "committed checkpoint is whole. RAYSHARD_DEBUG=1 shows every rank's error", file=sys.stderr)
            if _debug():
                print(str(failed), file=sys.stderr)
            return 1
        print(f"rayshard: training stopped: {failed}", file=sys.stderr)
        for rank, text in sorted(failed.tracebacks.items())[:1]:  # unexpected: a short traceback
            print(f"rank {rank}, last frames (RAYSHARD_DEBUG=1 shows them all):\n"
                  + (text if _debug() else _short_traceback(text)), file=sys.stderr)
        return 1
    except RayshardError as error:
        return _report(error)
    except BrokenPipeError:  # `rayshard ... | head`: the reader left; not an error of ours
        # Python would complain again flushing stdout at exit (as its docs advise, point it at devnull).
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except _storage_errors() as error:
        if _from_ray(error):
            raise  # Ray's own errors (a lost node, a timeout) carry their own cause and traceback
        return _report(error)
    except (ValueError, ImportError) as error:
        # fsspec refuses a URL scheme it does not know (ValueError) or whose package is not
        # installed (ImportError), wherever a URL is first opened: the store, --resume, --out.
        if not _unknown_protocol(error):
            raise
        return _report(RayshardError(f"a URL's scheme is not served here ({_first_line(error)}). Fix: use a local path "
                                     "or s3://bucket/prefix, or install the fsspec package the scheme needs"))


def _unknown_protocol(error: BaseException) -> bool:
    text = str(error)
    return (isinstance(error, ValueError) and text.startswith("Protocol not known")) or (
        isinstance(error, ImportError) and any("fsspec" in frame.filename for frame in traceback.extract_tb(error.__traceback__)))


def _report(error: BaseException) -> int:
    """One line on stderr, prefixed with the rank that raised it; the traceback (the remote one for
    a rank's error) only with RAYSHARD_DEBUG=1. Exit 2 for input and checkpoint errors, 3 for storage."""
    rank = rank_of(error)
    if _debug():
        remote = getattr(error, "remote_traceback", "")
        if remote:
            print(remote, file=sys.stderr)
        else:  # secrets in frames and messages are hidden by redacted_output, as everywhere
            print("".join(traceback.format_exception(error)), file=sys.stderr, end="")
    prefix = "rayshard: error: " + (f"rank {rank}: " if rank is not None else "")
    if isinstance(error, RayshardError):
        print(f"{prefix}{error}", file=sys.stderr)
        return 3 if isinstance(error, StoreUnavailable) else 2
    if isinstance(error, (FileExistsError, NotADirectoryError, IsADirectoryError)):
        # A path given on the command line that is in the way (a file where a directory must go, or
        # the reverse): the user's input, not the store's health.
        print(f"{prefix}{error.filename or ''}: {error.strerror or type(error).__name__}. Fix: "
              "pass a path that is free or of the right kind (a new directory for --out, a file for --png/--json)",
              file=sys.stderr)
        return 2
    # s3fs turns S3 failures into OSError once its retries are spent; a user needs the call and
    # the reason, not a botocore traceback (which never holds credentials either way).
    call = _storage_call(error)
    where = f", in {call}" if call else ""
    if isinstance(error, PermissionError):  # 403: retrying cannot help, the policy or the keys must change
        print(f"{prefix}storage request refused: PermissionError: {_first_line(error)}{where}. Fix: the credentials "
              "in use may not make this request: check the store URL, the keys or profile in the environment and "
              "their policy (deploy/s3-iam-policy.json lists every call rayshard makes)", file=sys.stderr)
        return 3
    print(f"{prefix}storage request failed: {type(error).__name__}: {_first_line(error)}{where}. "
          "Fix: check the store URL, its credentials and endpoint (AWS_ENDPOINT_URL) and the network, then run "
          "the command again; nothing partial is visible (a checkpoint commits only with its manifest). "
          "RAYSHARD_DEBUG=1 shows the traceback", file=sys.stderr)
    return 3


_OUR_LAYERS = tuple(str(Path(__file__).resolve().parents[2] / layer) + os.sep
                    for layer in ("plans", "storage", "actors", "cluster"))


def _storage_call(error: BaseException) -> str | None:
    """The last call rayshard's own code made before a storage error, as `Store.runs (fs.exists(...))`:
    which request failed, without a traceback."""
    ours = [(frame, line) for frame, line in traceback.walk_tb(error.__traceback__)
            if frame.f_code.co_filename.startswith(_OUR_LAYERS) and frame.f_code.co_filename != __file__
            and not frame.f_globals.get("__name__", "").endswith(".bounded_calls")]  # the deadline's wrapper
    if not ours:
        return None
    frame, number = ours[-1]
    line = linecache.getline(frame.f_code.co_filename, number).strip()
    name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)  # co_qualname: Python 3.11+
    return f"{name} (`{line}`)" if line else name


def _debug() -> bool:
    return os.environ.get("RAYSHARD_DEBUG", "") not in ("", "0")


def _short_traceback(text: str, frames: int = 3) -> str:
    """The last `frames` frames and the error line of a traceback text."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("File ")]
    return "\n".join(lines[starts[-frames]:] if len(starts) >= frames else lines[-2 * frames - 1:])


def _from_ray(error: BaseException) -> bool:
    # An error can come from Ray only once Ray is imported; looking it up imports nothing.
    ray_exceptions = sys.modules.get("ray.exceptions")
    return ray_exceptions is not None and isinstance(error, ray_exceptions.RayError)


def _storage_errors() -> tuple[type[BaseException], ...]:
    # botocore's errors exist only once s3fs has imported it, the Azure SDK's once adlfs has;
    # looking them up imports nothing.
    botocore = sys.modules.get("botocore.exceptions")
    azure = sys.modules.get("azure.core.exceptions")
    errors: tuple[type[BaseException], ...] = (OSError,)
    errors += () if botocore is None else (botocore.BotoCoreError, botocore.ClientError)
    return errors if azure is None else errors + (azure.AzureError,)


def _first_line(error: BaseException) -> str:
    """The message's first line; with the next one where it ends in ':' (botocore's "Parameter
    validation failed:" says what failed on its second line)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


if __name__ == "__main__":
    sys.exit(main())
