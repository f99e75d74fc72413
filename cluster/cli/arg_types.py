"""Argument types for the counts, amounts and file names the command line takes: a value out of
range fails while the arguments are parsed, in argparse's one error line naming the flag, before
it can divide by zero, loop without end, wait forever or fail deep in a library further in."""
from __future__ import annotations

import argparse
import math

from rayshard.plans.errors import ConfigError
from rayshard.plans.run_names import check_checkpoint_ref, run_name_problem


def whole_number(minimum: int, maximum: int | None = None):
    """An argparse type: an integer >= minimum (and <= maximum, where a planning command would
    otherwise build a plan too large for memory)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum} (a plan past it outgrows a planning command's "
                                             f"memory and time), got {value}")
        return value
    parse.__name__ = f"whole number >= {minimum}"
    return parse


def finite_number(minimum: float = 0.0, above: bool = True):
    """An argparse type: a finite float above `minimum` (or at least it, above=False)."""
    bound = f"> {minimum:g}" if above else f">= {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {bound}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value
    parse.__name__ = f"number {bound}"
    return parse


def layer_counts(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated whole numbers (layers per pipeline stage), e.g. 1,3."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated layer counts, e.g. 1,3") from None
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError(f"{text!r}: a stage cannot hold fewer than 0 layers")
    return counts


def run_name(text: str) -> str:
    """An argparse type: a run's name, as `train --run` checks it (plans/run_names.py): a name
    with '/' or '..' would read, write or delete outside the store."""
    problem = run_name_problem(text)
    if problem:
        raise argparse.ArgumentTypeError(f"{text!r} is {problem}")
    return text


def checkpoint_ref(text: str) -> str:
    """An argparse type: RUN[@STEP] whose RUN is a run name, `latest`, or a checkpoint URL/path."""
    try:
        return check_checkpoint_ref(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error.constraint}") from None


def png_path(text: str) -> str:
    """An argparse type: a file name ending in .png (the pictures are drawn as PNG only)."""
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"{text!r} does not end in .png; the picture is a PNG, e.g. resume.png")
    return text


POSITIVE = finite_number(0.0, above=True)
NON_NEGATIVE = finite_number(0.0, above=False)
AT_LEAST_ONE = whole_number(1)
# What the planning commands simulate or cut: past any real pipeline (the largest published runs
# use pp <= 64 and a few hundred microbatches), and small enough that the worst plan (256 x 1024)
# is simulated in minutes, not hours or out of memory (64 x 512 takes ~15 s on one core).
PIPELINE_RANKS = whole_number(1, maximum=256)
STAGES_PER_RANK = whole_number(1, maximum=64)
MICROBATCHES = whole_number(1, maximum=1024)
LAYERS = whole_number(1, maximum=100_000)
AT_LEAST_ZERO = whole_number(0)
