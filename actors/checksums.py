"""Chunk checksums: computing them incrementally, and reading which algorithm a manifest used.

A manifest records each checksum as `ALGORITHM:xxxxxxxx`. Format 2 writes CRC32C (the
Castagnoli polynomial, computed by the `crc32c` package with the CPU's CRC instruction):
~12 GB/s here against ~3.3 GB/s for zlib's CRC32, which had become the largest single cost of a
local load (docs/decisions.md). It is also the checksum S3 itself offers for uploads. Format 1
checkpoints carry zlib CRC32 and stay readable: a reader takes the algorithm from the expected
value, never from its own default.
"""
from __future__ import annotations

import zlib

import crc32c

from plans.errors import CheckpointError

WRITTEN = "crc32c"
# algorithm -> (bytes-like, running value) -> new running value; both release the GIL on large
# buffers, so a read on one rank thread and a checksum on another overlap.
_EXTEND = {
    "crc32c": lambda data, running: crc32c.crc32c(data, running),
    "crc32": zlib.crc32,
}


class RunningChecksum:
    """A checksum fed in pieces (a chunk streamed in blocks, a large read in windows)."""

    __slots__ = ("algorithm", "_extend", "value")

    def __init__(self, algorithm: str = WRITTEN):
        self.algorithm, self._extend, self.value = algorithm, _EXTEND[algorithm], 0

    def update(self, data) -> "RunningChecksum":
        self.value = self._extend(data, self.value)
        return self

    def text(self) -> str:
        return f"{self.algorithm}:{self.value:08x}"


def checksum(data, algorithm: str = WRITTEN) -> str:
    return RunningChecksum(algorithm).update(data).text()


def algorithm_of(recorded: str, where: str = "manifest") -> str:
    """The algorithm a recorded checksum was made with, or a clear error for one we cannot check."""
    algorithm = recorded.partition(":")[0]
    if algorithm not in _EXTEND:
        raise CheckpointError(f"{where}: checksum {recorded!r} uses {algorithm!r}, which this rayshard cannot "
                              f"verify (it knows {', '.join(sorted(_EXTEND))}); upgrade rayshard to read it")
    return algorithm


def running_like(recorded: str, where: str = "manifest") -> RunningChecksum:
    """A running checksum of the same algorithm as a recorded one, to compare against it."""
    return RunningChecksum(algorithm_of(recorded, where))


def matches(recorded: str, buffers, where: str = "manifest") -> bool:
    """Whether bytes given as consecutive buffers (one, or a row per buffer) have the recorded checksum."""
    running = running_like(recorded, where)
    for buffer in buffers:
        running.update(buffer)
    return running.text() == recorded
