"""Handing the pieces one dp replica read to the others, in buckets, while it is still reading.

With read-once loads (object stores) each replicated piece is read by one dp replica and
broadcast to the rest. Pieces are packed into flat buckets of at most `bucket_bytes` (one
collective per bucket, not one per tensor): each reader's pieces, in its walk order, cut where
the dtype, device or group changes or the bucket is full; then the readers' buckets are taken in
turns (reader 0's first, reader 1's first, reader 0's second, ...). The readers fetch their
buckets in that order, so the first collective can start as soon as the first bucket is read
and the hand-over runs beside the rest of the reading instead of after it. Every replica walks
the same pieces in the same order (they hold the same regions), so all of them cut the same
buckets without talking.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Bucket:
    reader: int  # dp coordinate of the replica that read these pieces
    dtype: torch.dtype
    device: torch.device
    group: object  # the dp process group the pieces' mesh uses
    members: list[int] = field(default_factory=list)  # indexes into the pieces, in packing order
    numel: int = 0


def buckets(pieces: Sequence[tuple[torch.Tensor, object]], readers: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """pieces: (local tensor, its dp group) in the order every replica walks them. Returns the
    buckets in broadcast order: each reader's own cut, the readers taking turns."""
    by_reader: dict[int, list[Bucket]] = {}
    for index, ((tensor, group), reader) in enumerate(zip(pieces, readers)):
        own = by_reader.setdefault(reader, [])
        last = own[-1] if own else None
        same_kind = (last is not None and (last.dtype, last.device) == (tensor.dtype, tensor.device)
                     and (last.group is group or _ranks(last.group) == _ranks(group)))
        if not same_kind or (last.numel + tensor.numel()) * tensor.element_size() > bucket_bytes:
            last = Bucket(reader, tensor.dtype, tensor.device, group)
            own.append(last)
        last.members.append(index)
        last.numel += tensor.numel()
    turns = [by_reader[reader] for reader in sorted(by_reader)]
    return [own[turn] for turn in range(max(map(len, turns), default=0)) for own in turns if turn < len(own)]


def broadcast_pieces(pieces: Sequence[tuple[torch.Tensor, object]], readers: Sequence[int], my_reader: int,
                     source_rank: Callable[[int], int], bucket_bytes: int,
                     ready: Callable[[int], None] = lambda bucket: None) -> int:
    """Fill every piece this replica did not read from the replica that did; bytes received.
    source_rank(reader): the global rank of that dp replica in this rank's other coordinates.
    ready(i): returns once this replica's reads for the i-th bucket of `buckets(...)` are in place."""
    received = 0
    for position, bucket in enumerate(buckets(pieces, readers, bucket_bytes)):
        tensors = [pieces[index][0] for index in bucket.members]
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        mine = bucket.reader == my_reader
        if mine:
            ready(position)
            torch.cat([tensor.reshape(-1) for tensor in tensors], out=flat)
        dist.broadcast(flat, src=source_rank(bucket.reader), group=bucket.group)
        if mine:
            continue
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset:offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
        received += flat.numel() * flat.element_size()
    return received


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))
