"""A node's snapshot keeper: a Ray actor that holds snapshot files in its node's memory.

Snapshots (issue 41) are ordinary rayshard checkpoints written to the `rayshard-snapshot://`
filesystem (`filesystem.py`), whose files live here instead of in a store. One keeper runs per
node, outside the ranks, so a rank's death loses nothing and only a node's loss takes its keeper's
copies (each file has a second copy on another node, `plans/checkpoint/snapshot_holders.py`).

A file is kept in this process's heap, so it outlives the process that wrote it, and in a form
that costs the writer little:
- a shard file arrives as a reference to the object the writer put into its node's object store
  once (`copy`); the keeper fetches it (from the same node's store, or across nodes by Ray's
  object transfer) and copies it into its heap: the copy owes nothing to the writer or its node
  (docs/decisions.md 180);
- small files (manifest, LATEST) arrive as a `bytes` argument (`put`, `create_only`, `replace_if`).
Conditional writes (create-only, compare-and-swap) are atomic here because every write of one path
goes through this one actor's lock.

Snapshots every step make a keeper copy the same files each step and drop the older ones (the
driver keeps only the newest): the arrays of dropped shard files wait in a pool, by exact size,
and the next copy of that size goes into one instead of freshly allocated memory (no page
faults, no kernel zeroing of every page; `array_pool.py`, docs/decisions.md 204). Reads of a
shard return a view of its array (`read_ranges`), which Ray copies into the object store as the reply:
no copy here (decision 205).
"""
from __future__ import annotations

import threading

import numpy as np
import ray

from rayshard.actors.snapshot.array_pool import ArrayPool

KEEPER_PREFIX = "rayshard-snapshot-keeper:"


def keeper_name(node_id: str) -> str:
    """The named actor keeping snapshot files on node_id."""
    return f"{KEEPER_PREFIX}{node_id}"


class PreconditionFailedHere(Exception):
    """A conditional write found another version (or none) than the one it was told to expect."""


class SnapshotKeeper:
    """path -> file, in this node's memory. Reads run concurrently (max_concurrency > 1);
    writes of one path serialise on the lock."""

    # How long a keeper waits for another node's object it is to copy; the writer's own bound on
    # the whole call is RAYSHARD_SNAPSHOT_TIMEOUT_S, and this one keeps the keeper's thread bounded too.
    FETCH_BOUND_S = 300.0

    def __init__(self, node_id: str):
        self.node_id = node_id
        self._files: dict[str, bytes | np.ndarray] = {}  # a shard's copy is a uint8 array
        self._lock = threading.Lock()
        self._pool = ArrayPool()  # the arrays of dropped shard files, for the next copies (array_pool.py)

    def put(self, path: str, data: bytes) -> int:
        with self._lock:
            self._pool.dropped(self._files.pop(path, None))
            self._files[path] = bytes(data)
        return len(data)

    def copy(self, path: str, wrapped: list, size: int, timeout_s: float = FETCH_BOUND_S) -> int:
        """Fetch [ref] (the writer's object, usually on another node) and keep a copy of its bytes
        in this process's heap: it owes nothing to the object's owner or node afterwards."""
        segments = ray.get(wrapped[0], timeout=timeout_s)  # views of this node's object store, no copy yet
        fetched = sum(segment.size for segment in segments)
        if fetched != size:
            raise ValueError(f"{path}: fetched {fetched} bytes, the writer put {size}")
        with self._lock:
            kept = self._pool.take(size)
        if segments:
            np.concatenate(segments, out=kept)  # the one copy, into this heap
        del segments  # the fetched object may go once the writer drops it
        with self._lock:
            self._pool.dropped(self._files.pop(path, None))  # a rewrite of a path frees its old array
            self._files[path] = kept
            self._pool.holding(kept)
        return size

    def pooled_bytes(self) -> int:
        return self._pool.pooled_bytes

    @property
    def reused(self) -> int:
        """Copies that went into the array of a dropped file."""
        return self._pool.reused

    def create_only(self, path: str, data: bytes) -> None:
        with self._lock:
            if path in self._files and bytes(self._files[path]) != data:
                raise FileExistsError(path)
            self._pool.dropped(self._files.pop(path, None))
            self._files[path] = bytes(data)

    def replace_if(self, path: str, data: bytes, expected: bytes | None) -> None:
        with self._lock:
            current = self._files.get(path)
            if (None if current is None else bytes(current)) != expected:
                raise PreconditionFailedHere(path)
            del current
            self._pool.dropped(self._files.pop(path, None))
            self._files[path] = bytes(data)

    def read_ranges(self, path: str, starts: list[int], ends: list[int]) -> tuple[np.ndarray | bytes, list[int]]:
        """Ranges of one file in one reply: (their bytes back to back, each range's length as found,
        shorter than asked where the file ends first). A load reads a column slice as one range
        per row (docs/decisions.md 218): thousands of ranges, one call. One range of a shard comes
        as a view of its array: Ray writes the view into the object store as the reply (the one
        copy; the reader gets a read-only array over it), and the view keeps the array out of the
        pool until then (decision 205). Several are gathered into one array, a copy of only the
        bytes asked."""
        value = self._files.get(path)
        if value is None:
            raise FileNotFoundError(path)
        pieces = [value[start:end] for start, end in zip(starts, ends)]
        lengths = [len(piece) for piece in pieces]
        if len(pieces) == 1:
            return pieces[0], lengths
        if isinstance(value, bytes):
            return b"".join(pieces), lengths
        return (np.concatenate(pieces) if pieces else np.empty(0, dtype=np.uint8)), lengths

    def listing(self, prefix: str = "") -> dict[str, int]:
        """Every file under prefix, with its size."""
        return {path: len(value) for path, value in list(self._files.items()) if path.startswith(prefix)}

    def remove(self, prefix: str) -> int:
        """Drop every file under prefix; how many bytes that frees."""
        with self._lock:
            freed = 0
            for path in [path for path in self._files if path.startswith(prefix)]:
                freed += len(self._files[path])
                self._pool.dropped(self._files.pop(path))
            return freed

    def bytes_held(self) -> int:
        return sum(len(value) for value in list(self._files.values()))
