"""Replica groups: which ranks hold the same piece, and which of them writes it on save and reads
it on load.

A piece held identically by several ranks (dp replicas, tp copies of a norm weight) must be
written by exactly one of them. Always picking the first copy makes the dp=0 ranks write the whole
model while their replicas idle; instead each replica group splits its pieces by bytes
(largest first onto the least-loaded member, Graham's LPT rule). Every member computes the same
split from the same list, so no communication is needed. One function, `pieces_written`, makes
the choice for the actors' real save (`actors/checkpoint/save.py`, on their local pieces) and
for the predicted writes of dry runs and offline reshards (`plans/checkpoint/writers.py`, on
predicted regions), so both give the same result. A read-once load splits its reading with the
same rule and salt (`assign_readers`).
"""
from __future__ import annotations

import heapq
import zlib
from collections.abc import Sequence
from dataclasses import replace
from functools import lru_cache

from rayshard.plans.layout.parallel_layout import MESH_DIM_NAMES, ParallelLayout, RankCoords


def replica_members(layout: ParallelLayout, coords: RankCoords, replicated_over: Sequence[str]) -> tuple[int, int]:
    """(this rank's index in its replica group, group size) for a piece copied along `replicated_over`."""
    index, size = 0, 1
    for dim in MESH_DIM_NAMES:
        if dim in replicated_over:
            extent = getattr(layout, dim)
            index, size = index * extent + getattr(coords, dim), size * extent
    return index, size


def replica_rank(layout: ParallelLayout, coords: RankCoords, replicated_over: Sequence[str], member: int) -> int:
    """The global rank of member `member` (as `replica_members` numbers them) of this rank's
    replica group for a piece copied along `replicated_over`."""
    place = {}
    for dim in reversed([d for d in MESH_DIM_NAMES if d in replicated_over]):
        extent = getattr(layout, dim)
        member, place[dim] = divmod(member, extent)
    return layout.rank_of(replace(coords, **place))


def group_salt(replicated_over: Sequence[str], coords: RankCoords) -> str:
    """Names one replica group: its copy dims plus the coordinates its members share."""
    shared = {dim: (0 if dim in replicated_over else getattr(coords, dim)) for dim in MESH_DIM_NAMES}
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


def _group_split(copy_dims: Sequence[tuple[str, ...]], piece_bytes: Sequence[int], layout: ParallelLayout,
                 coords: RankCoords) -> list[int]:
    """For each piece, the member of its replica group (as `replica_members` numbers them) that
    handles it: each group's pieces, in listed order, split by `assign_writers` (a piece no other
    rank holds is a group of one)."""
    members_of = [0] * len(piece_bytes)
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, dims in enumerate(copy_dims):
        groups.setdefault(dims, []).append(index)
    for dims, members in groups.items():
        _, size = replica_members(layout, coords, dims)
        split = assign_writers([piece_bytes[i] for i in members], size, group_salt(dims, coords))
        for index, member in zip(members, split):
            members_of[index] = member
    return members_of


def pieces_written(copy_dims: Sequence[tuple[str, ...]], piece_bytes: Sequence[int], layout: ParallelLayout,
                   coords: RankCoords) -> list[int]:
    """The indices of the pieces this rank writes, in the order its file holds them (`file_position`,
    listed order within), given each piece's copy dims and bytes as every member of its replica
    group lists them."""
    split = _group_split(copy_dims, piece_bytes, layout, coords)
    my_member = {dims: replica_members(layout, coords, dims)[0] for dims in set(copy_dims)}
    mine = [index for index, (dims, member) in enumerate(zip(copy_dims, split)) if member == my_member[dims]]
    return sorted(mine, key=lambda index: file_position(copy_dims[index]))  # stable: listed order within


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
    split = _group_split(handed_over, piece_bytes, layout, coords)
    return [replica_rank(layout, coords, dims, member) for dims, member in zip(handed_over, split)]


def read_once_readers(regions: Sequence, piece_bytes: Sequence[int], layout: ParallelLayout,
                      coords: RankCoords) -> list[int | None]:
    """On load, the global rank that reads each piece (a `Region`) from storage for its replica
    group (None: not handed over, this rank reads it). Pieces listed in the same order on every
    replica; the split is `assign_readers`'."""
    return read_once_readers_by_copies([region.replicated_over for region in regions], piece_bytes, layout, coords)


def read_once_readers_by_copies(replicated_over: Sequence[tuple[str, ...]], piece_bytes: Sequence[int],
                                layout: ParallelLayout, coords: RankCoords) -> list[int | None]:
    """`read_once_readers` given each piece's copy dims (a layout's targets as columns have no
    `Region` records)."""
    dims = [handover_dims(copies) if layout.dp > 1 else () for copies in replicated_over]
    shared = [i for i, handed in enumerate(dims) if handed]
    readers: list[int | None] = [None] * len(dims)
    split = assign_readers([dims[i] for i in shared], [piece_bytes[i] for i in shared], layout, coords)
    for index, reader in zip(shared, split):
        readers[index] = reader
    return readers
