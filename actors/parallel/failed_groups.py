"""A failed run's process groups, kept alive until every operation they might still hold has timed
out, then let go (decision 233).

A gloo group's destructor waits for its worker threads, and a worker may sit in an operation
that the failure left waiting on a peer (FSDP's collectives run there). Run with the interpreter
lock held, as the last reference is dropped in a collection, that wait froze the whole rank:
measured, dp2 x tp2 with rank 3 dead mid-step, the three survivors all stopped answering in the
collection that followed their leaving, so the driver named them silent. So a rank that fails
keeps its run's groups here (its root mesh holds every mesh group, the hand-over groups their
own), as it did when DTensor's caches held them by accident, and lets go of them at a later
set-up once the groups' own timeout has passed since the failure: by then each operation has
ended, with its timeout error at worst, and the destructor does not wait. A run that ends well
frees its groups as its ranks shut down: nothing is in flight then.
"""
from __future__ import annotations

import time

# Past the groups' timeout, so an operation that started just before the failure has ended too.
MARGIN_S = 2.0

_KEPT: list[tuple[float, object]] = []  # (monotonic time after which it may go, what holds the groups)


def keep_until_timed_out(holders: object, timeout_s: float) -> None:
    """Hold `holders` (what references a failed run's groups) for `timeout_s` + a margin."""
    _KEPT.append((time.monotonic() + timeout_s + MARGIN_S, holders))


def release_timed_out() -> None:
    """Let go of the groups whose operations have all timed out."""
    now = time.monotonic()
    _KEPT[:] = [(after, holders) for after, holders in _KEPT if after > now]
