"""Who writes what when any program saves a state dict: every distinct piece once, replicas
sharing the writing by bytes.

The trainer knows its layout (dp, fsdp, tp, pp), so each of its ranks computes alone which
replica writes a piece (`replicas.pieces_written`). A state dict from any loop carries no such
layout: a norm weight under FSDP2 x TP is a DTensor on the fsdp sub-mesh whose copies on the tp
ranks no placement mentions, a pipeline stage holds keys the others do not, a plain tensor may be
on every rank or on a few. So the API's save does what DCP's planner does, once per save and with
small records: every rank lists the pieces it holds (`HeldPiece`: name, kind, region, dtype, no
bytes), the coordinating rank groups identical pieces by the set of ranks holding them and splits
each group's pieces by bytes with the trainer's own rule (`replicas.assign_writers`), and sends each
rank the indices it writes. Decision 105. Pure: records in, indices out.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rayshard.plans.checkpoint.replicas import assign_writers
from rayshard.plans.checkpoint.safetensors_layout import ITEMSIZE
from rayshard.plans.errors import CheckpointError


@dataclass(frozen=True, slots=True)
class HeldPiece:
    """One piece of one global tensor a rank holds: tensor (name, kind) of `global_shape`, the
    region at `offsets` of extent `sizes`, stored as `dtype` (a torch dtype name)."""

    name: str
    kind: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.sizes) * ITEMSIZE[self.dtype]


def choose_writers(held: Sequence[Sequence[HeldPiece]]) -> list[list[int]]:
    """For each rank, the indices (into its own list) of the pieces it writes. A piece held
    identically by several ranks is written by one of them; each set of holders splits its pieces
    by bytes (largest first onto the least-loaded holder). Refuses a tensor whose ranks disagree on
    its global shape or dtype, naming it and two ranks."""
    described: dict[tuple[str, str], tuple[tuple[int, ...], str, int]] = {}
    holders: dict[tuple, list[tuple[int, int]]] = {}  # piece -> [(rank, index in its list)], in rank order
    for rank, pieces in enumerate(held):
        for index, piece in enumerate(pieces):
            seen = described.setdefault((piece.name, piece.kind), (piece.global_shape, piece.dtype, rank))
            if seen[:2] != (piece.global_shape, piece.dtype):
                raise CheckpointError(
                    f"{piece.name} ({piece.kind}): rank {seen[2]} holds it as {seen[1]}{list(seen[0])} but rank {rank} "
                    f"as {piece.dtype}{list(piece.global_shape)}; every rank must pass the same tensor. Fix: save the "
                    "same model and optimizer on every rank of the process group")
            holders.setdefault((piece.name, piece.kind, piece.offsets, piece.sizes), []).append((rank, index))
    groups: dict[tuple[int, ...], list[tuple]] = {}  # holder ranks -> their shared pieces, first-seen order
    for key, places in holders.items():
        groups.setdefault(tuple(rank for rank, _ in places), []).append(key)
    written: list[list[int]] = [[] for _ in held]
    for ranks, keys in groups.items():
        sizes = [held[holders[key][0][0]][holders[key][0][1]].nbytes for key in keys]
        members = assign_writers(sizes, len(ranks), ",".join(map(str, ranks)))
        for key, member in zip(keys, members):
            rank, index = holders[key][member]
            written[rank].append(index)
    return [sorted(indices) for indices in written]
