"""Handing the pieces one dp replica read to the others, in buckets.

With read-once loads (object stores) each replicated piece is read by one dp replica and
broadcast to the rest. One broadcast per tensor cost a gloo round trip each (hundreds per
load); packing consecutive pieces of one reader, dtype and group into flat buckets of at most
`bucket_bytes` makes a load a few large collectives, with at most one bucket of extra memory.
Every replica walks the same pieces in the same order (they hold the same regions), so all
of them cut the same buckets without talking.
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
    tensors: list[torch.Tensor] = field(default_factory=list)
    numel: int = 0


def buckets(pieces: Sequence[tuple[torch.Tensor, object]], readers: Sequence[int], bucket_bytes: int) -> list[Bucket]:
    """pieces: (local tensor, its dp group) in the order every replica walks them."""
    cut: list[Bucket] = []
    for (tensor, group), reader in zip(pieces, readers):
        last = cut[-1] if cut else None
        same_kind = (last is not None and (last.reader, last.dtype, last.device) == (reader, tensor.dtype, tensor.device)
                     and (last.group is group or _ranks(last.group) == _ranks(group)))
        if not same_kind or (last.numel + tensor.numel()) * tensor.element_size() > bucket_bytes:
            last = Bucket(reader, tensor.dtype, tensor.device, group)
            cut.append(last)
        last.tensors.append(tensor)
        last.numel += tensor.numel()
    return cut


def broadcast_pieces(pieces: Sequence[tuple[torch.Tensor, object]], readers: Sequence[int], my_reader: int,
                     source_rank: Callable[[int], int], bucket_bytes: int) -> int:
    """Fill every piece this replica did not read from the replica that did; bytes received.
    source_rank(reader): the global rank of that dp replica in this rank's other coordinates."""
    received = 0
    for bucket in buckets(pieces, readers, bucket_bytes):
        flat = torch.empty(bucket.numel, dtype=bucket.dtype, device=bucket.device)
        mine = bucket.reader == my_reader
        if mine:
            torch.cat([tensor.reshape(-1) for tensor in bucket.tensors], out=flat)
        dist.broadcast(flat, src=source_rank(bucket.reader), group=bucket.group)
        if mine:
            continue
        offset = 0
        for tensor in bucket.tensors:
            tensor.copy_(flat[offset:offset + tensor.numel()].view(tensor.shape))
            offset += tensor.numel()
        received += flat.numel() * flat.element_size()
    return received


def _ranks(group) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))
