"""Which bytes a rank must read to fill its piece of a tensor from a checkpoint's chunks.

Pure geometry over chunk metadata: intersect the target region with every stored chunk of the
same tensor, turn each intersection into the byte range of whole chunk rows that contain it
(chunks are row-major, so rows are contiguous), and prove that the intersections cover the
target exactly once. The loader executes these items; dry runs print them.
"""
from __future__ import annotations

from dataclasses import dataclass

from plans.chunks import Chunk
from plans.errors import CheckpointError


@dataclass(frozen=True)
class ReadItem:
    chunk: Chunk
    byte_start: int  # absolute, within chunk.file
    byte_end: int
    rows: tuple[int, int]  # chunk-local dim-0 rows [start, stop) the byte range holds
    offsets: tuple[int, ...]  # global region of the intersection
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.byte_end - self.byte_start


def _intersect(a_off, a_size, b_off, b_size):
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


def _volume(sizes) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def plan_reads(chunks: list[Chunk], offsets: tuple[int, ...], sizes: tuple[int, ...], what: str = "") -> list[ReadItem]:
    """Read items that exactly cover the region (offsets, sizes). Raises if coverage fails."""
    target_volume = _volume(sizes)
    if target_volume == 0:
        return []
    items: list[ReadItem] = []
    covered = 0
    for chunk in chunks:
        if len(chunk.offsets) != len(offsets):
            raise CheckpointError(f"{what}: stored rank {len(chunk.offsets)} differs from target rank {len(offsets)}")
        overlap = _intersect(chunk.offsets, chunk.sizes, offsets, sizes)
        if overlap is None:
            continue
        inter_off, inter_size = overlap
        covered += _volume(inter_size)
        if chunk.sizes:
            row_bytes = _volume(chunk.sizes[1:]) * chunk.itemsize
            first = inter_off[0] - chunk.offsets[0]
            rows = (first, first + inter_size[0])
            start = chunk.byte_start + rows[0] * row_bytes
            end = chunk.byte_start + rows[1] * row_bytes
        else:
            rows, start, end = (0, 1), chunk.byte_start, chunk.byte_end
        items.append(ReadItem(chunk, start, end, rows, inter_off, inter_size))
    if covered != target_volume:
        # Chunks of one tensor never overlap (checked on save), so a volume mismatch means gaps.
        raise CheckpointError(
            f"{what}: the checkpoint's chunks cover {covered} of the {target_volume} elements needed "
            f"for region offsets={offsets} sizes={sizes}; the checkpoint is incomplete or its manifest is damaged"
        )
    return items


def check_chunks_disjoint_and_complete(chunks: list[Chunk]) -> None:
    """Every tensor's chunks tile its global shape exactly: no overlap, no gap."""
    by_tensor: dict[tuple[str, str], list[Chunk]] = {}
    for chunk in chunks:
        by_tensor.setdefault((chunk.name, chunk.kind), []).append(chunk)
    for (name, kind), group in by_tensor.items():
        shape = group[0].global_shape
        total = sum(c.numel for c in group)
        if total != _volume(shape):
            raise CheckpointError(f"{name} ({kind}): chunks hold {total} elements, global shape {shape} needs {_volume(shape)}")
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                if _intersect(a.offsets, a.sizes, b.offsets, b.sizes) is not None:
                    raise CheckpointError(f"{name} ({kind}): chunks at {a.offsets} and {b.offsets} overlap")
