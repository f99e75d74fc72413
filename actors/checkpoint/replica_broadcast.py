"""Handing the pieces one replica read to the others, in buckets, while it is still reading.
A banded tensor's blocks (row-parallel weights at a tp that cuts their stored rows, on object
stores) go the same way, scattered by columns instead of broadcast whole (`SlicedPiece`).

With read-once loads (object stores) each replicated piece is read by one member of its replica
group (dp replicas; dp and tp for a norm weight copied on every rank) and broadcast to the rest.
Pieces are packed into flat buckets of at most `bucket_bytes` (one collective per bucket, not one
per tensor): each reader's pieces, in its walk order, cut where the dtype, device or group
changes or the bucket is full; then the readers' buckets are taken in turns (the lowest rank's
first, the next one's first, ..., the lowest rank's second, ...). The readers fetch their
buckets in that order, so the first collective can start as soon as the first bucket is read
and the hand-over runs beside the rest of the reading instead of after it. Every member of a
group walks the group's pieces in the same order (they hold the same regions), so all of them
cut the same buckets without talking.

Pieces come in phases, one per kind of replica group (dp only; dp and tp; ...), and every rank
broadcasts phase by phase. Within a phase a rank is in one group and its members walk the same
buckets; two ranks that share groups of two kinds could otherwise take them in opposite orders
and wait on each other forever.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class HandedPiece:
    """A piece handed over within its replica group: this rank's local tensor of it, and the
    process group of that replica group."""

    tensor: torch.Tensor
    group: object


@dataclass(frozen=True, slots=True)
class SlicedPiece:
    """A block of whole rows of a banded tensor (`plans/checkpoint/column_bands.py`): one member of
    the hand-over group reads it and every member takes its own columns of it, by scatter, not
    the whole block by broadcast (docs/decisions.md 146).

    tensor: the block as read on its reader; elsewhere an allocation-free stand-in of the same
    shape, dtype and device (bucketing reads only those). columns: each group member's [start,
    stop) along dim 1 of the block, by group rank. mine: where this rank's columns land."""

    tensor: torch.Tensor
    group: object
    columns: tuple[tuple[int, int], ...]
    mine: torch.Tensor


@dataclass
class Bucket:
    reader: int  # global rank of the replica that read these pieces
    dtype: torch.dtype
    device: torch.device
    group: object  # the process group of the pieces' replica group
    members: list[int] = field(default_factory=list)  # indexes into the pieces, in packing order
    numel: int = 0
    sliced: bool = False  # SlicedPieces, scattered; else HandedPieces, broadcast


def buckets(pieces: Sequence[HandedPiece | SlicedPiece], readers: Sequence[int], bucket_bytes: int,
            phases: Sequence[int] | None = None) -> list[Bucket]:
    """pieces: in the order every member walks them; readers: the global rank that read each; phases: each piece's phase (default: one
    phase). Returns the buckets in broadcast order: phase by phase, each reader's own cut, the
    readers taking turns."""
    phases = phases if phases is not None else [0] * len(pieces)
    cut: list[Bucket] = []
    for phase in sorted(set(phases)):
        by_reader: dict[int, list[Bucket]] = {}
        for index, (piece, reader) in enumerate(zip(pieces, readers)):
            if phases[index] != phase:
                continue
            tensor, group = piece.tensor, piece.group
            own = by_reader.setdefault(reader, [])
            last = own[-1] if own else None
            sliced = isinstance(piece, SlicedPiece)
            same_kind = (last is not None and (last.dtype, last.device, last.sliced) == (tensor.dtype, tensor.device, sliced)
                         and (last.group is group or _ranks(last.group) == _ranks(group)))
            if not same_kind or (last.numel + tensor.numel()) * tensor.element_size() > bucket_bytes:
                last = Bucket(reader, tensor.dtype, tensor.device, group, sliced=sliced)
                own.append(last)
            last.members.append(index)
            last.numel += tensor.numel()
        turns = [by_reader[reader] for reader in sorted(by_reader)]
        cut += [own[turn] for turn in range(max(map(len, turns), default=0)) for own in turns if turn < len(own)]
    return cut


def broadcast_pieces(pieces: Sequence[HandedPiece | SlicedPiece], cut: Sequence[Bucket], my_rank: int,
                     ready: Callable[[int], None] = lambda bucket: None) -> int:
    """Fill every piece this rank did not read from the member that did; bytes received.
    cut: `buckets(pieces, ...)`; ready(i): returns once this rank's reads for cut[i] are in place."""
    received = 0
    for position, bucket in enumerate(cut):
        if bucket.sliced:
            received += _scatter_columns([pieces[index] for index in bucket.members], bucket, my_rank,
                                         lambda: ready(position))
            continue
        tensors = [pieces[index].tensor for index in bucket.members]
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        mine = bucket.reader == my_rank
        if mine:
            ready(position)
            torch.cat([tensor.reshape(-1) for tensor in tensors], out=flat)
        dist.broadcast(flat, src=bucket.reader, group=bucket.group)
        if mine:
            continue
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset:offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
        received += flat.numel() * flat.element_size()
    return received


def _scatter_columns(blocks: Sequence[SlicedPiece], bucket: Bucket, my_rank: int, ready: Callable[[], None]) -> int:
    """One scatter from the bucket's reader: member m gets its columns of every block, back to back
    (padded to the longest member's, as a collective's tensors are all one size); bytes received."""
    members = len(blocks[0].columns)
    padded = max(sum(block.tensor[:, slice(*block.columns[m])].numel() for block in blocks) for m in range(members))
    out = torch.empty(padded, dtype=bucket.dtype, device=bucket.device)
    mine = bucket.reader == my_rank
    parts = None
    if mine:
        ready()
        parts = []
        for m in range(members):
            flat = torch.empty(padded, dtype=bucket.dtype, device=bucket.device)  # the padding is never read
            at = 0
            for block in blocks:
                piece = block.tensor[:, slice(*block.columns[m])]
                flat[at:at + piece.numel()].view(piece.shape).copy_(piece)
                at += piece.numel()
            parts.append(flat)
    dist.scatter(out, parts, src=bucket.reader, group=bucket.group)
    at = 0
    for block in blocks:
        block.mine.copy_(out[at:at + block.mine.numel()].view(block.mine.shape))
        at += block.mine.numel()
    return 0 if mine else at * out.element_size()


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))
