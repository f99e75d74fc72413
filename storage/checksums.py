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

import functools
import zlib

import crc32c

from rayshard.plans.errors import CheckpointError

try:
    from isal.isal_zlib import crc32 as _crc32  # the same values as zlib.crc32, ~18x faster here
    from isal.isal_zlib import crc32_combine as _crc32_combine
except ImportError:  # a platform without an isal wheel: slower, never different
    _crc32, _crc32_combine = zlib.crc32, None

WRITTEN = "crc32"
# algorithm -> (bytes-like, running value) -> new running value.
_EXTEND = {
    "crc32": _crc32,
    "crc32c": lambda data, running: crc32c.crc32c(data, running),
}
# Both are reflected CRC-32s; combining needs their polynomials (bit-reversed).
_POLYNOMIALS = {"crc32": 0xEDB88320, "crc32c": 0x82F63B78}


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


def combine(algorithm: str, first: int, second: int, second_length: int) -> int:
    """The checksum of A + B from the checksums of A and of B (B being `second_length` bytes).

    Ranks that each read part of a chunk hold the checksums of their parts; combined in byte
    order they give the chunk's, so partial reads are verified without reading anything twice.
    It is zlib's crc32_combine: multiply A's value by x^(8 * len(B)) modulo the polynomial."""
    if algorithm == "crc32" and _crc32_combine is not None:
        return _crc32_combine(first, second, second_length)  # ~100x faster than the lines below
    polynomial = _POLYNOMIALS[algorithm]
    return _multiply(_x_to_the_power(8 * second_length, polynomial), first, polynomial) ^ second


def _multiply(a: int, b: int, polynomial: int) -> int:
    """a * b modulo the polynomial, in the reflected representation (bit 31 is x^0)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ polynomial if b & 1 else b >> 1
    return product


@functools.lru_cache(maxsize=4096)  # parts repeat a few lengths: one multiply a combine after the first
def _x_to_the_power(exponent: int, polynomial: int) -> int:
    """x^exponent modulo the polynomial, by squaring (x^1 is bit 30)."""
    result, square = 1 << 31, 1 << 30
    while exponent:
        if exponent & 1:
            result = _multiply(square, result, polynomial)
        exponent >>= 1
        if exponent:
            square = _multiply(square, square, polynomial)
    return result
