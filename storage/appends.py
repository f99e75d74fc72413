"""Appending to an object on a store that has no append: read it with its version, write it back
extended only if nobody changed it meanwhile, and try again if somebody did.

Object stores replace objects whole, and a plain read-extend-write lets two writers each drop the
other's lines (a second trainer on a run erased the first one's metrics this way). The
compare-and-swap every backend already offers for LATEST makes each append see every earlier
one: whatever the interleaving of processes, the object only ever grows by whole appends, and
the bytes one writer appended are never lost to another's.
"""
from __future__ import annotations

import random
import time

from rayshard.storage.backends.protocol import Backend, PreconditionFailed

MAX_ATTEMPTS = 50  # a busy object: each lost race costs one read and one write; give up past this


def append_bytes(backend: Backend, path: str, data: bytes, attempts: int = MAX_ATTEMPTS) -> None:
    """Append data to the object at path (created when missing); TimeoutError after `attempts`
    lost races, naming the object."""
    for attempt in range(attempts):
        current, version = backend.read_versioned(path)
        try:
            backend.replace_if(path, (current or b"") + data, version)
            return
        except PreconditionFailed:
            time.sleep(random.uniform(0, min(1.0, 0.01 * 2**attempt)))  # another writer appended: read again
    raise TimeoutError(f"{path}: could not append after {attempts} attempts, other writers kept changing it. "
                       "Fix: run one writer per run (a trainer's writer lease ensures it), then retry")
