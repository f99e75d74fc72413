"""Row-parallel weights at a tp that cuts their stored rows, on object stores: the tp group reads
the whole rows once and hands each member its columns (docs/decisions.md 146).

A row-parallel weight (`wo`, `down`: sharded along dim 1 over tp) is a column slice of every
stored chunk whose columns the tp group cuts. Where the store reads short row segments as whole
rows (`min_segment_bytes`, object stores: decision 114), every tp rank would read the whole rows:
up to tp-fold the bytes. Instead the members' regions, which differ only along dim 1 and together
cover the tensor's full width, form one *band*: whole rows of the tensor, so every overlap with a
stored chunk is whole chunk rows, one contiguous byte range. The band's rows are split into one
disjoint share per member of the hand-over group (the tp ranks, and their dp replicas where a
read-once load hands pieces over along dp too), each share cut into blocks of at most
`max_block_bytes`; the member reading a block hands every member its columns of it
(`actors/checkpoint/replica_broadcast.py`, the replicas' hand-over). Every byte of the band is
read once across the group, and a block that covers a whole chunk reads it whole, so its
checksum is verified as it lands; the parts of a chunk cut across blocks are verified together
(decision 47).

Pure: regions, chunks and integers in, blocks out. The same functions serve a rank's load (its
own group) and the dry run over a whole layout (`banded_target_table`, every group).
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rayshard.plans.checkpoint.reshard import OVERREAD_DENOMINATOR, overlap_bytes_read, _intersect
from rayshard.plans.checkpoint.target_table import READS_ITSELF, TargetTable
from rayshard.plans.layout.parallel_layout import ParallelLayout

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (global offsets, sizes)

# A block is handed over by one collective: small enough that the first goes out early in a read,
# as the replicas' broadcast buckets (actors/checkpoint/load.py BROADCAST_BUCKET_BYTES).
BAND_BLOCK_BYTES = 16 * 2**20


@dataclass(frozen=True, slots=True)
class BandBlock:
    """Whole rows of a band that one member reads and hands over: `reader` is the member's index
    in the hand-over group; the box spans the band's full width."""

    reader: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def band_of(regions: Sequence[Box]) -> Box | None:
    """The box the members' regions tile when they differ only along dim 1 and their dim-1 ranges
    (repeats allowed: dp replicas) are back to back; None otherwise (nothing to band)."""
    if not regions or len(regions[0][0]) < 2:
        return None
    first_offsets, first_sizes = regions[0]

    def past_dim_1(box: Box) -> Box:  # the box without its dim 1
        return box[0][:1] + box[0][2:], box[1][:1] + box[1][2:]

    reference = past_dim_1(regions[0])
    if any(past_dim_1(box) != reference for box in regions) or 0 in reference[1]:
        return None
    spans = sorted({(offsets[1], offsets[1] + sizes[1]) for offsets, sizes in regions if sizes[1] > 0})
    if len(spans) < 2 or any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
        return None
    offsets = (first_offsets[0], spans[0][0], *first_offsets[2:])
    sizes = (first_sizes[0], spans[-1][1] - spans[0][0], *first_sizes[2:])
    return offsets, sizes


def worth_banding(chunks: Sequence, regions: Sequence[Box], band: Box, min_segment_bytes: int) -> bool:
    """Whether some member would read more than 1 + 1/OVERREAD_DENOMINATOR of what it needs from
    some chunk on its own (a column slice read as whole rows). `chunks`: the tensor's stored
    chunks overlapping the band. With exact row segments (local files) nobody over-reads: no band."""
    if min_segment_bytes <= 0:
        return False
    for chunk in chunks:
        for offsets, sizes in set(regions):
            overlap = _intersect(chunk.offsets, chunk.sizes, offsets, sizes)
            if overlap is None:
                continue
            needed = math.prod(overlap[1]) * chunk.itemsize
            read = overlap_bytes_read(chunk, *overlap, min_segment_bytes)
            if read * OVERREAD_DENOMINATOR > needed * (OVERREAD_DENOMINATOR + 1):
                return True
    return False


def split_band(band: Box, members: int, itemsize: int, max_block_bytes: int, salt: str = "") -> list[BandBlock]:
    """The band's rows in `members` disjoint shares of (nearly) equal rows, each cut into blocks of
    at most max_block_bytes (at least one row). The share order is rotated by `salt` (the tensor's
    name) so a group's small tensors are not all read by member 0."""
    offsets, sizes = band
    rows, row_bytes = sizes[0], math.prod(sizes[1:]) * itemsize
    rows_per_block = max(1, max_block_bytes // max(1, row_bytes))
    # (an empty share has no block: reader_shares then lists only members that read something)
    rotation = zlib.crc32(salt.encode()) % members if salt else 0
    blocks = []
    for share in range(members):
        first, stop = rows * share // members, rows * (share + 1) // members
        for start in range(first, stop, rows_per_block):
            height = min(rows_per_block, stop - start)
            blocks.append(BandBlock((share + rotation) % members, (offsets[0] + start, *offsets[1:]),
                                    (height, *sizes[1:])))
    return blocks


def reader_shares(blocks: Sequence[BandBlock]) -> dict[int, Box]:
    """Each reader's share of the band (its blocks are back to back): what it reads as one target,
    so a share that covers a stored chunk reads it as one whole-chunk item, verified as it lands;
    the blocks only cut the hand-over."""
    shares: dict[int, Box] = {}
    for block in blocks:
        if block.reader in shares:
            offsets, sizes = shares[block.reader]
            shares[block.reader] = offsets, (sizes[0] + block.sizes[0], *sizes[1:])
        else:
            shares[block.reader] = block.offsets, block.sizes
    return shares


# ---- a whole layout's dry run ----------------------------------------------------------------------


def banded_target_table(targets: TargetTable, index, layout: ParallelLayout, min_segment_bytes: int,
                        read_once: bool = True, max_block_bytes: int = BAND_BLOCK_BYTES) -> TargetTable:
    """The targets a load on `layout` reads when its tp groups read banded weights once
    (`load_destinations` on each rank): each banded piece becomes received (its `receive_from`
    another member of its group), and each member gets its share of the band to read itself.
    `index`: the checkpoint's `ChunkIndex`. Unchanged where nothing is banded (tp 1, exact row
    segments, a read-once hand-over turned off)."""
    if layout.tp == 1 or min_segment_bytes <= 0 or not read_once or not len(targets):
        return targets
    with_dp = layout.dp > 1
    rank = targets.rank
    tp_coord = rank % layout.tp
    dp_coord = (rank // (layout.tp * layout.fsdp)) % layout.dp
    base = rank - tp_coord - (dp_coord * layout.fsdp * layout.tp if with_dp else 0)  # the group's first rank
    candidate = np.flatnonzero(targets.ndim >= 2)
    order = candidate[np.lexsort((rank[candidate], targets.kind_code[candidate], targets.name_code[candidate],
                                  base[candidate]))]
    keys = np.stack([base[order], targets.name_code[order], targets.kind_code[order]], axis=1)
    starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)]) if len(order) else np.zeros(0, np.int64)
    stops = np.r_[starts[1:], len(order)]
    group_size = layout.tp * (layout.dp if with_dp else 1)
    received = targets.receive_from.copy()
    added: dict[str, list] = {key: [] for key in ("rank", "name", "kind", "ndim", "offsets", "sizes", "itemsize")}
    for low, high in zip(starts.tolist(), stops.tolist()):
        rows = order[low:high]
        if len(rows) != group_size or len(np.unique(targets.offsets[rows, 1])) < 2:
            continue
        ndim = int(targets.ndim[rows[0]])
        regions = [(tuple(targets.offsets[r, :ndim].tolist()), tuple(targets.sizes[r, :ndim].tolist())) for r in rows]
        band = band_of(regions)
        name, kind = targets.names[targets.name_code[rows[0]]], targets.kinds[targets.kind_code[rows[0]]]
        tensor = index.get((name, kind))
        if band is None or tensor is None or not worth_banding(tensor.overlapping(*band), regions, band, min_segment_bytes):
            continue
        members = rank[rows]  # in rank order: the group's member order
        received[rows] = np.roll(members, 1)  # anyone else in the group: the piece is not read for itself
        itemsize = int(targets.itemsize[rows[0]])
        for reader, (offsets, sizes) in sorted(reader_shares(split_band(band, len(rows), itemsize, max_block_bytes,
                                                                        name)).items()):
            added["rank"].append(int(members[reader]))
            added["name"].append(int(targets.name_code[rows[0]]))
            added["kind"].append(int(targets.kind_code[rows[0]]))
            added["ndim"].append(ndim)
            added["offsets"].append(offsets + (0,) * (targets.width - ndim))
            added["sizes"].append(sizes + (0,) * (targets.width - ndim))
            added["itemsize"].append(itemsize)
    if not added["rank"]:
        return targets
    count = len(added["rank"])
    rank_all = np.r_[rank, np.array(added["rank"], np.int64)]
    order = np.argsort(rank_all, kind="stable")  # rows stay in rank order, each rank's shares after its pieces
    return TargetTable(targets.world_size, targets.names, targets.kinds, rank_all[order],
                       np.r_[targets.name_code, np.array(added["name"], np.int32)][order],
                       np.r_[targets.kind_code, np.array(added["kind"], np.int32)][order],
                       np.r_[targets.ndim, np.array(added["ndim"], np.int64)][order],
                       np.r_[targets.offsets, np.array(added["offsets"], np.int64)][order],
                       np.r_[targets.sizes, np.array(added["sizes"], np.int64)][order],
                       np.r_[received, np.full(count, READS_ITSELF, np.int64)][order],
                       np.r_[targets.itemsize, np.array(added["itemsize"], np.int64)][order])
