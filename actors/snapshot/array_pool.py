"""The arrays of a keeper's dropped shard files, kept by exact size for the next copy of that size.

Snapshots every step make a keeper copy the same files each step and drop the older ones (the
driver keeps only the newest snapshot): a copy into an array from here touches pages that are
already mapped, where a fresh array costs a page fault and the kernel's zeroing for every page
(docs/decisions.md 204). Two rules keep it safe and small:
- an array enters only when nothing but the pool holds it: a read in flight keeps a view of its
  file's array (whose base it references) until Ray has copied the reply into the object store,
  and such an array is let go instead, never written over;
- files and pool together never exceed the most the keeper has held in files: pooling does not
  raise the keeper's peak memory, and when every file is dropped the pool empties.
Not thread-safe: the keeper calls it under its lock. A plain class, not an actor's method, so the
reference counts it reads are not raised by Ray's wrappers of actor methods.
"""
from __future__ import annotations

import sys

import numpy as np


class ArrayPool:
    def __init__(self):
        self._free: dict[int, list[np.ndarray]] = {}  # size -> arrays nobody else references
        self.pooled_bytes = 0
        self.held_bytes = 0  # bytes of the keeper's files held as arrays
        self.peak_held_bytes = 0
        self.reused = 0  # arrays handed out again (tests and benches read it)

    def take(self, size: int) -> np.ndarray:
        """An array of size bytes for a new file: a pooled one if there is one, else a new one."""
        free = self._free.get(size)
        while free:
            array = free.pop()
            self.pooled_bytes -= array.size
            if sys.getrefcount(array) <= 2:  # `array` and getrefcount's argument: still nobody else's
                self.reused += 1
                return array
        return np.empty(size, np.uint8)

    def holding(self, array: np.ndarray) -> None:
        """array is now one of the keeper's files."""
        self.held_bytes += array.size
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        self._trim()

    def dropped(self, value) -> None:
        """value has just left the keeper's files; callers pass the removal itself
        (`pool.dropped(files.pop(path))`) and keep no name for it, so a count above this frame's
        own means a reader (or a listing's temporary list) still holds it."""
        if not isinstance(value, np.ndarray):
            return  # small files are bytes, not pooled
        self.held_bytes -= value.size
        if value.size and sys.getrefcount(value) <= 2:  # `value` and getrefcount's argument
            self._free.setdefault(value.size, []).append(value)
            self.pooled_bytes += value.size
        self._trim()

    def _trim(self) -> None:
        """Let pooled arrays go, largest first, until files and pool fit under the peak; all of
        them once no file is left (nothing is being snapshotted: the run dropped them all)."""
        for size in sorted(self._free, reverse=True):
            free = self._free[size]
            while free and (self.held_bytes + self.pooled_bytes > self.peak_held_bytes or self.held_bytes == 0):
                self.pooled_bytes -= free.pop().size
            if not free:
                del self._free[size]
