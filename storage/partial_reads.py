"""Chunks read in parts, verified together.

A load checks a chunk against the manifest's checksum as it lands when one target reads all of
it. When a layout change cuts a chunk across targets (fsdp rows of a tp chunk, a tp2 column half
into fsdp4 rows), each rank reads only its part and cannot check it alone: an edit inside such a
part would load, and the next save would write it with a fresh, valid checksum. So every partial
read carries the checksum of the bytes it read, and whoever sees all of a chunk's parts (the
driver of a training load or of an offline reshard; the one process of a digest) combines them
in byte order into the chunk's checksum (`checksums.combine`) and compares. Nothing is read
twice. A chunk whose parts do not tile it (another rank's read failed) is left for the caller to
read whole.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from rayshard.storage.checksums import algorithm_of, combine
from rayshard.plans.errors import CheckpointError
from rayshard.plans.checkpoint.reshard import ReadItem


class PartialRead(NamedTuple):
    """One part of one chunk as read, and the checksum of those bytes (the chunk's algorithm)."""

    name: str
    kind: str
    file: str
    chunk_start: int
    chunk_end: int
    recorded: str  # the chunk's checksum in the manifest
    start: int  # the part's bytes in the file
    end: int
    value: int


def partial_read(item: ReadItem, value: int) -> PartialRead:
    chunk = item.chunk
    return PartialRead(chunk.name, chunk.kind, chunk.file, chunk.byte_start, chunk.byte_end, chunk.checksum,
                       item.byte_start, item.byte_end, value)


class Outcome(NamedTuple):
    verified: int  # chunks whose parts combined to their recorded checksum
    mismatched: list[PartialRead]  # one part of each chunk whose parts did not
    untiled: list[PartialRead]  # one part of each chunk whose parts do not cover it exactly once


def check_partial_reads(reads: Iterable[PartialRead]) -> Outcome:
    """Combine each chunk's parts in byte order and compare with the manifest."""
    by_chunk: dict[tuple[str, int], dict[tuple[int, int], PartialRead]] = {}
    mismatched, untiled, verified = [], [], 0
    disagreeing: set[tuple[str, int]] = set()
    for read in reads:
        key = (read.file, read.chunk_start)
        parts = by_chunk.setdefault(key, {})
        earlier = parts.setdefault((read.start, read.end), read)
        if earlier.value != read.value:  # two ranks read the same bytes and got different ones
            disagreeing.add(key)
    for key, parts in by_chunk.items():
        first = next(iter(parts.values()))
        if key in disagreeing:
            mismatched.append(first)
            continue
        chain = _tiling(first.chunk_start, first.chunk_end, sorted(parts))
        if chain is None:
            untiled.append(first)
            continue
        algorithm = algorithm_of(first.recorded)
        value = parts[chain[0]].value
        for start, end in chain[1:]:
            value = combine(algorithm, value, parts[(start, end)].value, end - start)
        if f"{algorithm}:{value:08x}" == first.recorded:
            verified += 1
        else:
            mismatched.append(first)
    return Outcome(verified, mismatched, untiled)


def _tiling(start: int, end: int, ranges: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """Ranges that cover [start, end) back to back, each once, in order; None if none do.
    (Ranks that read the same rows read identical ranges; sorted by start, a range can only
    extend a chain that ends where it begins.)"""
    reached: dict[int, tuple[int, int] | None] = {start: None}
    for low, high in ranges:
        if low in reached and high not in reached and low < high <= end:
            reached[high] = (low, high)
    if end not in reached:
        return None
    chain, at = [], end
    while at != start:
        low, high = reached[at]
        chain.append((low, high))
        at = low
    return chain[::-1]


def mismatch_error(mismatched: list[PartialRead], base: str) -> CheckpointError:
    names = [f"{base}/{r.file}: {r.name} ({r.kind}) at bytes [{r.chunk_start}, {r.chunk_end})" for r in mismatched]
    return CheckpointError(
        f"checksum mismatch in {len(names)} chunk(s) read in parts by several ranks (their parts' checksums do "
        f"not add up to the manifest's): {'; '.join(names[:10])}{' ...' if len(names) > 10 else ''}. The file "
        "changed or is corrupt. Fix: restore it from a copy, or resume from another checkpoint")
