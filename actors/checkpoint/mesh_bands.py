"""Banded reads for a state dict's DTensors on any mesh: `rayshard.checkpoint.load` from an object
store, where a mesh dim cuts a tensor's columns (a row-parallel weight's `Shard(1)` over tp).

The trainer's load bands row-parallel weights over its tp groups (docs/decisions.md 146,
`actors/checkpoint/load.py`), knowing its layout. A state dict from another loop carries no
layout, but each DTensor names its mesh and placements, which is all banding needs: for a mesh
dim whose placement shards tensor dim 1, the ranks along that dim (the others' coordinates
fixed) hold regions that differ only along dim 1, computed for every member from the same
placements (`region_at`). Where they tile a band of whole rows (`band_of`) that some member would
over-read alone (`worth_banding`), the band is split into one share per member (`split_band`),
each member reads its share as whole rows, and every block's reader scatters each member its
columns over the mesh dim's own process group: the trainer's hand-over
(`read_and_hand_over`, `SlicedPiece`), unchanged.

Every member derives the same bands from the same manifest and placements, but the members'
state dicts are the callers' own: a member that lists another key, or none, would leave the
others waiting in a scatter. So the bands are agreed first (`agreed_bands`, on the first rank,
from every rank's `signature`s): a band is kept only where every member of its group listed it
alike; any other is read by each member for itself, as before. Groups are taken in one global
order (their ranks, sorted), the bands of a group by key, so two ranks that share groups of two
kinds never wait on each other in opposite orders.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from rayshard.actors.checkpoint.mesh_replicas import ReplicaPiece
from rayshard.actors.checkpoint.read_executor import Destination
from rayshard.actors.checkpoint.replica_broadcast import HandedPiece, SlicedPiece
from rayshard.actors.checkpoint.state_dict import FlatState
from rayshard.actors.parallel.shards import region_at
from rayshard.plans.checkpoint.column_bands import (BAND_BLOCK_BYTES, BandBlock, band_of, reader_shares, split_band,
                                                   worth_banding)
from rayshard.plans.checkpoint.reshard import Target

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class MeshBand:
    """One state-dict tensor this rank fills from a band its mesh dim's group reads once."""

    key: str  # the state dict key: the order of a group's bands
    target: Target  # this rank's piece (received, not read)
    local: torch.Tensor  # where its columns land
    group: object  # the mesh dim's process group
    ranks: tuple[int, ...]  # the group's global ranks, by group rank (= member index)
    member: int  # this rank's member index
    band: Box
    regions: tuple[Box, ...]  # every member's region, by member index
    blocks: tuple[BandBlock, ...]
    share: Target | None  # the band's rows this rank reads, if any
    staging: torch.Tensor | None  # where it reads them

    @property
    def signature(self) -> tuple:
        """What every member of the group must list alike for the band to be read this way."""
        return self.ranks, self.key, self.band, self.blocks


def mesh_bands(flat: FlatState, index, min_segment_bytes: int) -> list[MeshBand]:
    """This rank's bands: each DTensor whose column slices a mesh dim's group would over-read on
    this store (`min_segment_bytes` > 0: an object store), with every member of that group holding
    a non-empty piece. At most one mesh dim per tensor (the first that bands)."""
    if min_segment_bytes <= 0:
        return []
    bands = []
    for piece in flat.pieces:
        tensor, held = piece.tensor, piece.held
        if not isinstance(tensor, DTensor) or len(held.global_shape) < 2 or (held.name, held.kind) not in index:
            continue
        band = _band_of(piece.key, tensor, held, piece.local, index, min_segment_bytes)
        if band is not None:
            bands.append(band)
    return bands


def _band_of(key: str, tensor: DTensor, held, local: torch.Tensor, index, min_segment_bytes: int) -> MeshBand | None:
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    shape, mesh_shape = tuple(held.global_shape), tuple(mesh.shape)
    for dim, placement in enumerate(tensor.placements):
        if not isinstance(placement, Shard) or placement.dim != 1 or mesh_shape[dim] < 2:
            continue
        regions, ranks = [], []
        for member in range(mesh_shape[dim]):
            at = list(coordinate)
            at[dim] = member
            regions.append(region_at(shape, mesh_shape, at, tensor.placements))
            ranks.append(int(mesh.mesh[tuple(at)].item()))
        if any(0 in sizes for _, sizes in regions):
            continue  # a member holding nothing lists no piece: it would not take part
        group = mesh.get_group(dim)
        if tuple(dist.get_process_group_ranks(group)) != tuple(ranks):
            continue  # a member index must be its group rank (the scatter's order)
        band = band_of(regions)
        if band is None or not worth_banding(index[(held.name, held.kind)].overlapping(*band), regions, band,
                                             min_segment_bytes):
            continue
        member = coordinate[dim]
        blocks = tuple(split_band(band, len(ranks), local.element_size(), BAND_BLOCK_BYTES, held.name))
        share = reader_shares(blocks).get(member)
        target = Target(held.name, held.kind, held.offsets, held.sizes)
        if share is None:  # a band of fewer rows than members: this one reads nothing
            return MeshBand(key, target, local, group, tuple(ranks), member, band, tuple(regions), blocks, None, None)
        staging = torch.empty(share[1], dtype=local.dtype, device=local.device)
        return MeshBand(key, target, local, group, tuple(ranks), member, band, tuple(regions), blocks,
                        Target(held.name, held.kind, *share), staging)
    return None


def agreed_bands(listed: list[tuple[int, list[tuple]]]) -> set[tuple[tuple[int, ...], str]]:
    """On the first rank, from every rank's (global rank, signatures): the (group ranks, key) of
    each band that every member of its group listed with the same band and blocks."""
    by_band: dict[tuple, dict[int, tuple]] = {}
    for rank, signatures in listed:
        for signature in signatures:
            by_band.setdefault((signature[0], signature[1]), {})[rank] = signature
    return {band for band, members in by_band.items()
            if set(members) == set(band[0]) and len(set(members.values())) == 1}


def destinations_with_bands(destinations: dict[Target, Destination], bands: list[MeshBand],
                            replicas: list[ReplicaPiece] = ()) -> dict[Target, Destination]:
    """What this rank reads itself: its pieces, less the banded ones and the replicas another
    member reads (received), plus its shares of the bands."""
    received = {band.target for band in bands} | {r.target for r in replicas if r.reader != r.member}
    mine = {target: destination for target, destination in destinations.items() if target not in received}
    for band in bands:
        if band.share is not None:
            mine[band.share] = Destination(band.staging, band.share.offsets)
    return mine


def hand_over_lists(bands: list[MeshBand], replicas: list[ReplicaPiece] = ()
                    ) -> tuple[list[HandedPiece | SlicedPiece], list[int], list[Target | None], list[int]]:
    """The bands' blocks and the replicas (readers set) as `read_and_hand_over` takes them:
    pieces, the global rank reading each, the target it is read in on its reader (else None), its
    phase (its group's place in the one global order of groups, bands' and replicas' alike)."""
    bands = sorted(bands, key=lambda band: (band.ranks, band.key))
    replicas = sorted(replicas, key=lambda replica: (replica.ranks, replica.key))
    order = {ranks: phase for phase, ranks in
             enumerate(sorted({band.ranks for band in bands} | {replica.ranks for replica in replicas}))}
    pieces, readers, read_as, phases = [], [], [], []
    for band in bands:
        band_offsets, _ = band.band
        columns = tuple((offsets[1] - band_offsets[1], offsets[1] - band_offsets[1] + sizes[1])
                        for offsets, sizes in band.regions)
        my_row = band.target.offsets[0]
        for block in band.blocks:
            mine = block.reader == band.member
            if mine:  # a view of the share this rank reads
                read = band.staging.narrow(0, block.offsets[0] - band.share.offsets[0], block.sizes[0])
            else:
                read = torch.empty((), dtype=band.local.dtype, device=band.local.device).expand(block.sizes)
            pieces.append(SlicedPiece(read, band.group, columns, band.local.narrow(0, block.offsets[0] - my_row,
                                                                                 block.sizes[0])))
            readers.append(band.ranks[block.reader])
            read_as.append(band.share if mine else None)
            phases.append(order[band.ranks])
    for replica in replicas:
        pieces.append(HandedPiece(replica.local, replica.group))
        readers.append(replica.ranks[replica.reader])
        read_as.append(replica.target if replica.reader == replica.member else None)
        phases.append(order[replica.ranks])
    return pieces, readers, read_as, phases
