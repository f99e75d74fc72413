"""Chunk checksums: computing them incrementally, and reading which algorithm a manifest used.

A manifest records each checksum as `ALGORITHM:xxxxxxxx`. Format 2.1 writes CRC32 (zlib's
polynomial) computed by ISA-L through the `isal` package: it folds 64 bytes at a time with
VPCLMULQDQ, ~93 GB/s on a cached 1 MiB block here against ~29 GB/s for CRC32C from the `crc32c`
package (format 2.0) and ~5 GB/s for zlib's own CRC32 (format 1.x); a verified local load of the
small preset spent a fifth of its CPU in CRC32C (docs/decisions.md 44). The values are the
same as zlib.crc32's, so any reader that knows CRC32 verifies them, and S3 offers CRC32 for
uploads too. A reader takes the algorithm from the expected value, never from its own default,
so 1.x (crc32) and 2.0 (crc32c) checkpoints stay readable and verifiable.
"""
from __future__ import annotations

import zlib

import crc32c

from plans.errors import CheckpointError

try:
    from isal.isal_zlib import crc32 as _crc32  # the same values as zlib.crc32, ~18x faster here
except ImportError:  # a platform without an isal wheel: slower, never different
    _crc32 = zlib.crc32

WRITTEN = "crc32"
# algorithm -> (bytes-like, running value) -> new running value.
_EXTEND = {
    "crc32": _crc32,
    "crc32c": lambda data, running: crc32c.crc32c(data, running),
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
