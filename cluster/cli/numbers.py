"""Argument types for the counts and amounts the command line takes: a value out of range fails
while the arguments are parsed, in argparse's one error line naming the flag, before it can
divide by zero, loop without end or wait forever further in."""
from __future__ import annotations

import argparse
import math


def whole_number(minimum: int):
    """An argparse type: an integer >= minimum."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
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


POSITIVE = finite_number(0.0, above=True)
NON_NEGATIVE = finite_number(0.0, above=False)
AT_LEAST_ONE = whole_number(1)
AT_LEAST_ZERO = whole_number(0)
