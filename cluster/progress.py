"""Progress of long work: tqdm byte bars on stderr for the `rayshard ckpt` commands, and the
protocol the tools that do the work report through.

A bar is drawn when stderr is a terminal; `--quiet` hides it and `--progress` draws it anyway (a
log file, a test). The functions that do the work take `progress`: a tqdm bar, or anything with
its `reset(total=...)` (called once the byte total is known) and `update(n)`; None draws nothing.
"""
from __future__ import annotations

import argparse
import sys

from tqdm import tqdm


def add_arguments(parser: argparse.ArgumentParser) -> None:
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--quiet", action="store_true", help="no progress bar")
    choice.add_argument("--progress", action="store_true",
                        help="draw the progress bar even when stderr is not a terminal")


def byte_bar(args: argparse.Namespace, desc: str, enabled: bool = True):
    shown = enabled and not getattr(args, "quiet", False) and (getattr(args, "progress", False) or sys.stderr.isatty())
    return tqdm(desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, disable=not shown,
                dynamic_ncols=True)


def set_total(progress, total: int) -> None:
    if progress is not None:
        progress.reset(total=total)


def advance(progress, nbytes: int) -> None:
    if progress is not None:
        progress.update(nbytes)


def counted(load, progress):
    """load, wrapped to advance progress by the bytes of the tensor it returns (an importer's
    lazy tensors count as the save writes them)."""
    def load_and_count():
        tensor = load()
        advance(progress, tensor.numel() * tensor.element_size())
        return tensor
    return load_and_count
