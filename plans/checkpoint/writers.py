"""Who writes each piece of training state: replicas are written once, and the writing is spread.

A piece held identically by several ranks (dp replicas, tp copies of a norm weight) must be
written by exactly one of them. Always picking the first copy makes the dp=0 ranks write the whole
model while their replicas idle; instead each replica group splits its pieces by bytes
(largest first onto the least-loaded member, Graham's LPT rule). Every member computes the same
split from the same list, so no communication is needed: the actors call `assign_writers` on
their local pieces, and `predicted_writes` calls it on predicted regions (for dry runs and for
synthetic manifests), with the same result.
"""
from __future__ import annotations

import heapq
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from plans.checkpoint.chunks import STATE_KINDS
from plans.layout.parallel_layout import ParallelLayout, RankCoords
from plans.training.model_spec import ModelConfig
from plans.pipeline.partition import StagePartition
from plans.checkpoint.safetensors_layout import ITEMSIZE
from plans.checkpoint.regions import Region, rank_regions, replica_members, replica_rank


def group_salt(replicated_over: Sequence[str], coords: RankCoords) -> str:
    """Names one replica group: its copy dims plus the coordinates its members share."""
    shared = {dim: (0 if dim in replicated_over else getattr(coords, dim)) for dim in ("pp", "dp", "fsdp", "tp")}
    return f"{','.join(replicated_over)}|" + ",".join(f"{k}{v}" for k, v in shared.items())


def file_position(replicated_over: Sequence[str]) -> int:
    """Where a piece goes in its writer's file: pieces only this rank holds first, then pieces
    copied across dp, then pieces copied across tp. A replica reading its share from a peer's file
    then finds it in one contiguous tail: one request instead of one per piece."""
    return 0 if not replicated_over else (2 if "tp" in replicated_over else 1)


def assign_writers(piece_bytes: Sequence[int], group_size: int, salt: str) -> list[int]:
    """The member (0..group_size-1) that writes each piece, for pieces listed in the same order on
    every member. The rotation by `salt` keeps member 0 from taking the largest piece of every group."""
    if group_size == 1:
        return [0] * len(piece_bytes)
    return list(_assign(tuple(piece_bytes), group_size, zlib.crc32(salt.encode()) % group_size))


@lru_cache(maxsize=8192)
def _assign(piece_bytes: tuple[int, ...], group_size: int, rotation: int) -> tuple[int, ...]:
    # Replicas call this with the same arguments: at 1024 ranks the cache does the work once per group.
    loads = [(0, (member - rotation) % group_size, member) for member in range(group_size)]
    heapq.heapify(loads)
    writers = [0] * len(piece_bytes)
    for index in sorted(range(len(piece_bytes)), key=lambda i: (-piece_bytes[i], i)):
        load, order, member = heapq.heappop(loads)
        writers[index] = member
        heapq.heappush(loads, (load + piece_bytes[index], order, member))
    return tuple(writers)


def handover_dims(replicated_over: Sequence[str]) -> tuple[str, ...]:
    """The dims a read-once load hands a piece over along: all of its copy dims within its
    pipeline stage, when dp is among them (else the piece is not handed over, every holder
    reads it). A norm weight copied on every dp and tp rank is read by one of them and
    broadcast to all, not read once per tp rank."""
    return tuple(dim for dim in replicated_over if dim != "pp") if "dp" in replicated_over else ()


def assign_readers(handed_over: Sequence[tuple[str, ...]], piece_bytes: Sequence[int], layout: ParallelLayout,
                   coords: RankCoords) -> list[int]:
    """On a read-once load, the global rank that reads each handed-over piece (`handover_dims`),
    for pieces listed in the same order on every member of their replica group. Each group is
    split by bytes with the writers' own rule and salt, so on a resume onto the layout that saved,
    every rank reads back exactly the pieces it wrote: its own file, front to back, which on an
    object store is one sequential GET per file instead of ranges scattered over its peers'."""
    readers = [0] * len(piece_bytes)
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, dims in enumerate(handed_over):
        groups.setdefault(tuple(dims), []).append(index)
    for dims, members in groups.items():
        _, size = replica_members(layout, coords, dims)
        split = assign_writers([piece_bytes[i] for i in members], size, group_salt(dims, coords))
        for index, member in zip(members, split):
            readers[index] = replica_rank(layout, coords, dims, member)
    return readers


def read_once_readers(regions: Sequence[Region], piece_bytes: Sequence[int], layout: ParallelLayout,
                      coords: RankCoords) -> list[int | None]:
    """On load, the global rank that reads each piece from storage for its replica group (None:
    not handed over, this rank reads it). Pieces listed in the same order on every replica; the
    split is `assign_readers`'."""
    dims = [handover_dims(region.replicated_over) if layout.dp > 1 else () for region in regions]
    shared = [i for i, handed in enumerate(dims) if handed]
    readers: list[int | None] = [None] * len(regions)
    split = assign_readers([dims[i] for i in shared], [piece_bytes[i] for i in shared], layout, coords)
    for index, reader in zip(shared, split):
        readers[index] = reader
    return readers


@dataclass(frozen=True)
class PlannedPiece:
    """A piece one rank writes: its tensor region, state kind and dtype."""

    region: Region
    kind: str
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.region.numel * ITEMSIZE[self.dtype]


def rank_writes(regions: Sequence[Region], kinds: Sequence[str], dtype: str, layout: ParallelLayout,
                coords: RankCoords) -> list[PlannedPiece]:
    """The pieces this rank writes, in module order (each tensor's kinds together)."""
    pieces = [PlannedPiece(region, kind, dtype) for region in regions if not region.tied_copy and region.numel
              for kind in kinds]
    chosen = [True] * len(pieces)
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, piece in enumerate(pieces):
        if piece.region.replicated_over:
            groups.setdefault(piece.region.replicated_over, []).append(index)
    for dims, members in groups.items():
        mine, size = replica_members(layout, coords, dims)
        writers = assign_writers([pieces[i].nbytes for i in members], size, group_salt(dims, coords))
        for index, writer in zip(members, writers):
            chosen[index] = writer == mine
    mine = [piece for piece, keep in zip(pieces, chosen) if keep]
    return sorted(mine, key=lambda piece: file_position(piece.region.replicated_over))  # stable: module order within


def predicted_writes(model: ModelConfig, layout: ParallelLayout, partition: StagePartition | None = None,
                     kinds: Sequence[str] = STATE_KINDS, dtype: str = "float32") -> list[list[PlannedPiece]]:
    """For every rank, the pieces it would write when saving this model in this layout."""
    return [rank_writes(rank_regions(model, layout, rank, partition), kinds, dtype, layout, layout.coords_of(rank))
            for rank in range(layout.world_size)]
