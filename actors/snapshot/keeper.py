"""A node's snapshot keeper: a Ray actor that holds snapshot files in its host memory.

Snapshots (issue 41) are ordinary rayshard checkpoints written to the `rayshard-snapshot://`
filesystem (`filesystem.py`), whose files live here instead of in a store. One keeper runs per
node, outside the ranks, so a rank's death loses nothing and only a node's loss takes its keeper's
copies (each file has a second copy on another node, `plans/checkpoint/snapshot_holders.py`).

The keeper copies what it is sent into its own heap (a `bytes` argument is deserialised, not
mapped from the sender's object store), so a file outlives the process that wrote it.
Conditional writes (create-only, compare-and-swap) are atomic here because every write of one path
goes through this one actor's lock.
"""
from __future__ import annotations

import threading

KEEPER_PREFIX = "rayshard-snapshot-keeper:"


def keeper_name(node_id: str) -> str:
    """The named actor keeping snapshot files on node_id."""
    return f"{KEEPER_PREFIX}{node_id}"


class PreconditionFailedHere(Exception):
    """A conditional write found another version (or none) than the one it was told to expect."""


class SnapshotKeeper:
    """path -> bytes, in this process's memory. Reads run concurrently (max_concurrency > 1);
    writes of one path serialise on the lock."""

    def __init__(self, node_id: str):
        self.node_id = node_id
        self._files: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def put(self, path: str, data: bytes) -> int:
        with self._lock:
            self._files[path] = bytes(data)
        return len(data)

    def create_only(self, path: str, data: bytes) -> None:
        with self._lock:
            if path in self._files and self._files[path] != data:
                raise FileExistsError(path)
            self._files[path] = bytes(data)

    def replace_if(self, path: str, data: bytes, expected: bytes | None) -> None:
        with self._lock:
            if self._files.get(path) != expected:
                raise PreconditionFailedHere(path)
            self._files[path] = bytes(data)

    def read(self, path: str, start: int | None = None, end: int | None = None) -> bytes:
        data = self._files.get(path)
        if data is None:
            raise FileNotFoundError(path)
        return data[start:end] if start is not None or end is not None else data

    def listing(self, prefix: str = "") -> dict[str, int]:
        """Every file under prefix, with its size."""
        return {path: len(data) for path, data in list(self._files.items()) if path.startswith(prefix)}

    def remove(self, prefix: str) -> int:
        """Drop every file under prefix; how many bytes that frees."""
        with self._lock:
            doomed = [path for path in self._files if path.startswith(prefix)]
            return sum(len(self._files.pop(path)) for path in doomed)

    def bytes_held(self) -> int:
        return sum(len(data) for data in list(self._files.values()))
