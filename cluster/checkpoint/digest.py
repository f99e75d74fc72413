"""Layout-independent digests of a checkpoint's tensors, and tensor-by-tensor comparison.

A tensor's digest is the SHA-256 of its global row-major bytes. It is computed by streaming the
tensor in blocks of whole rows in global order, each block filled through the same planned
ranged reads a load uses, so it never depends on how the chunks were cut (which layout wrote
them) and never holds more than one block (BLOCK_BYTES) in memory, whatever the model size.

Blocks are cut at chunk row boundaries where possible, so most chunks are read whole and their
CRC32 is verified on the way; a chunk taller than a block is read in parts whose checksums are
combined once the tensor has streamed by: a digest run is also a full integrity check.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.cluster.progress import advance, set_total
from rayshard.plans.checkpoint.chunks import PARAM, STATE_KINDS, Chunk
from rayshard.plans.checkpoint.reshard import TableTensor

BLOCK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class TensorDigest:
    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    sha256: str

    def line(self) -> str:
        return f"{self.sha256}  {self.kind:<10} {self.name}  {self.dtype}{list(self.shape)}"


def _tensors(stored: StoredCheckpoint) -> dict[tuple[str, str], Chunk]:
    """Each tensor's first chunk, by name then kind (column-wise: one record per tensor)."""
    kind_order = {kind: i for i, kind in enumerate(STATE_KINDS)}
    firsts = stored.chunks.first_of_each_tensor()
    return dict(sorted(firsts.items(), key=lambda item: (item[0][0], kind_order.get(item[0][1], 99), item[0][1])))


def row_blocks(group: list[Chunk] | TableTensor, block_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) row blocks covering the tensor, cut at chunk row boundaries when possible.
    group: the tensor's chunks, or its rows in the index (read column-wise: a 16k-rank tensor has
    thousands of chunks, and a record each cost diff ~5 s before its first read)."""
    shape, itemsize, starts, stops = _row_extents(group)
    if not shape:
        return [(0, 1)]
    rows = shape[0]
    row_bytes = itemsize
    for size in shape[1:]:
        row_bytes *= size
    per_block = max(1, block_bytes // max(1, row_bytes))
    boundaries = sorted({0, rows} | set(starts) | set(stops))
    blocks, start, last_fit = [], 0, 0
    for boundary in boundaries[1:]:
        if boundary - start <= per_block:
            last_fit = boundary
            continue
        if last_fit > start:
            blocks.append((start, last_fit))
            start = last_fit
        while boundary - start > per_block:  # a chunk taller than a block: equal row blocks
            blocks.append((start, start + per_block))
            start += per_block
        last_fit = boundary
    if start < rows:
        blocks.append((start, rows))
    return blocks


def _row_extents(group: list[Chunk] | TableTensor) -> tuple[tuple[int, ...], int, list[int], list[int]]:
    """(global shape, item size, each chunk's first row, each chunk's end row)."""
    if isinstance(group, TableTensor):
        first = group.table.chunks_at(group.rows[:1])[0]
        if not first.global_shape:
            return (), first.itemsize, [], []
        starts = group.table.boxes["offsets"][group.rows, 0]
        stops = starts + group.table.boxes["sizes"][group.rows, 0]
        return first.global_shape, first.itemsize, np.unique(starts).tolist(), np.unique(stops).tolist()
    first = group[0]
    if not first.global_shape:
        return (), first.itemsize, [], []
    return first.global_shape, first.itemsize, [c.offsets[0] for c in group], [c.offsets[0] + c.sizes[0] for c in group]


def stream_tensor(stored: StoredCheckpoint, name: str, kind: str, block_bytes: int = BLOCK_BYTES,
                  blocks: list[tuple[int, int]] | None = None) -> Iterator[torch.Tensor]:
    """The global tensor as consecutive row blocks. Chunks taller than a block are read in parts;
    once the whole tensor has streamed by, their parts' checksums are combined and checked, so
    every byte is verified (before the caller's last step with the tensor, e.g. a digest)."""
    tensor = stored.index[(name, kind)]
    shape = tensor.table.chunks_at(tensor.rows[:1])[0].global_shape
    for start, stop in blocks or row_blocks(tensor, block_bytes):
        if not shape:
            yield stored.read_region(name, kind, (), ())
        else:
            yield stored.read_region(name, kind, (start, *([0] * (len(shape) - 1))), (stop - start, *shape[1:]))
    stored.check_partial_reads()


def _bytes(block: torch.Tensor) -> memoryview:
    return block.reshape(-1).view(torch.uint8).numpy().data


def digest_checkpoint(url_or_stored: str | StoredCheckpoint, block_bytes: int = BLOCK_BYTES,
                      progress=None) -> list[TensorDigest]:
    """progress: a bar (cluster/progress.py) advanced by the bytes of each block hashed; its total
    is set here unless the caller set one (a diff counts both checkpoints on one bar)."""
    stored = url_or_stored if isinstance(url_or_stored, StoredCheckpoint) else StoredCheckpoint(url_or_stored)
    if progress is not None and not progress.total:
        set_total(progress, stored_bytes(stored))
    digests = []
    for (name, kind), first in _tensors(stored).items():
        hasher = hashlib.sha256()
        for block in stream_tensor(stored, name, kind, block_bytes):
            hasher.update(_bytes(block))
            advance(progress, block.numel() * block.element_size())
        digests.append(TensorDigest(name, kind, first.dtype, first.global_shape, "sha256:" + hasher.hexdigest()))
    return digests


def weights_digest(url: str) -> str:
    """The layout-free digest of a checkpoint's parameters, its moments left out: how a LoRA
    checkpoint names the base its adapters were trained on (decision 125)."""
    stored = StoredCheckpoint(url)
    digests = []
    for (name, kind), first in _tensors(stored).items():
        if kind != PARAM:
            continue
        hasher = hashlib.sha256()
        for block in stream_tensor(stored, name, kind):
            hasher.update(_bytes(block))
        digests.append(TensorDigest(name, kind, first.dtype, first.global_shape, "sha256:" + hasher.hexdigest()))
    return checkpoint_digest(digests)


def stored_bytes(stored: StoredCheckpoint) -> int:
    return stored.chunks.total_bytes()  # the chunks tile every tensor once


def checkpoint_digest(digests: list[TensorDigest]) -> str:
    """One digest for the whole state: of every tensor's name, kind, dtype, shape and digest."""
    hasher = hashlib.sha256()
    for digest in sorted(digests, key=lambda d: (d.name, d.kind)):
        hasher.update(f"{digest.name}|{digest.kind}|{digest.dtype}|{list(digest.shape)}|{digest.sha256}\n".encode())
    return "sha256:" + hasher.hexdigest()


@dataclass(frozen=True)
class TensorDifference:
    name: str
    kind: str
    status: str  # "equal", "different", "only in a", "only in b", "shape/dtype differ"
    detail: str = ""


def diff_checkpoints(url_a: str, url_b: str, block_bytes: int = BLOCK_BYTES, progress=None) -> list[TensorDifference]:
    """Compare two checkpoints tensor by tensor; for tensors that differ, stream both and report
    how many elements differ and the largest absolute difference. progress: a bar advanced by
    the bytes hashed on both sides."""
    a_side, b_side = StoredCheckpoint(url_a), StoredCheckpoint(url_b)
    set_total(progress, stored_bytes(a_side) + stored_bytes(b_side))
    digests_a = {(d.name, d.kind): d for d in digest_checkpoint(a_side, block_bytes, progress)}
    digests_b = {(d.name, d.kind): d for d in digest_checkpoint(b_side, block_bytes, progress)}
    result = []
    for key in sorted(set(digests_a) | set(digests_b)):
        name, kind = key
        if key not in digests_b:
            result.append(TensorDifference(name, kind, "only in a"))
        elif key not in digests_a:
            result.append(TensorDifference(name, kind, "only in b"))
        elif (digests_a[key].dtype, digests_a[key].shape) != (digests_b[key].dtype, digests_b[key].shape):
            a, b = digests_a[key], digests_b[key]
            result.append(TensorDifference(name, kind, "shape/dtype differ", f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"))
        elif digests_a[key].sha256 == digests_b[key].sha256:
            result.append(TensorDifference(name, kind, "equal"))
        else:
            result.append(TensorDifference(name, kind, "different", _numeric_difference(a_side, b_side, name, kind, block_bytes)))
    return result


_SAME_SIZE_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _numeric_difference(a_side: StoredCheckpoint, b_side: StoredCheckpoint, name: str, kind: str, block_bytes: int) -> str:
    """How two stored tensors differ, element by element and bit for bit (as the digests compare
    them): the same NaN on both sides is equal, -0.0 and 0.0 are not. The largest |a-b| is over
    the elements that differ and are numbers on both sides; a NaN against a number is counted apart."""
    count, largest, total, against_nan = 0, 0.0, 0, 0
    blocks = row_blocks(a_side.index[(name, kind)], block_bytes)  # the same row blocks on both sides
    for a, b in zip(stream_tensor(a_side, name, kind, blocks=blocks), stream_tensor(b_side, name, kind, blocks=blocks)):
        bits = _SAME_SIZE_INTEGER[a.element_size()]
        differ = a.contiguous().view(bits) != b.contiguous().view(bits)
        count += int(differ.sum())
        total += a.numel()
        if a.is_floating_point() and bool(differ.any()):
            gaps = (a[differ].double() - b[differ].double()).abs()
            numbers = gaps[~gaps.isnan()]
            against_nan += gaps.numel() - numbers.numel()
            if numbers.numel():
                largest = max(largest, float(numbers.max()))
    return (f"{count} of {total} elements differ, max |a-b| = {largest:.3g}"
            + (f" ({against_nan} of them a NaN against a number or another NaN)" if against_nan else ""))
