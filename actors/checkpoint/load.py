"""A rank's side of a load: fill its parameters and AdamW moments from a checkpoint written by any
layout, reading (or, on object stores, reading once per replica group and handing over) exactly
the byte ranges that overlap its pieces.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rayshard.storage.manifest_io import read_manifest
from rayshard.actors.parallel.group_sockets import recording_group_sockets
from rayshard.actors.checkpoint.rank_pieces import MOMENTS, ties_embeddings, rank_layout, replicated_dims, state_tensors
from rayshard.actors.checkpoint.read_executor import Destination
from rayshard.actors.checkpoint.collector_paused import collector_paused
from rayshard.actors.checkpoint.replica_broadcast import HandedPiece, SlicedPiece, broadcast_pieces, buckets
from rayshard.actors.checkpoint.shard_writer import dtype_name
from rayshard.actors.checkpoint.stored import StoredCheckpoint, min_segment_bytes_for
from rayshard.actors.parallel.shards import local_region, local_tensor, region_at
from rayshard.plans.checkpoint.chunks import PARAM, Chunk
from rayshard.plans.checkpoint.column_bands import (BAND_BLOCK_BYTES, BandBlock, band_of, reader_shares, split_band,
                                                   worth_banding)
from rayshard.plans.checkpoint.model_check import raise_if_mismatched
from rayshard.plans.checkpoint.reshard import Target
from rayshard.plans.checkpoint.replicas import assign_readers, group_salt, handover_dims, replica_members, replica_rank
from rayshard.plans.errors import CheckpointError
from rayshard.plans.layout.parallel_layout import DATA_MESH_DIMS, STAGE_MESH_DIMS, ParallelLayout, RankCoords
from rayshard.storage.backends.registry import open_url


@dataclass(frozen=True)
class LoadScope:
    """What a load fills: the parameters named in `only` (None: all) and, with `moments`, their
    AdamW moments."""

    only: frozenset[str] | None = None
    moments: bool = True

    def fills(self, name: str) -> bool:
        return self.only is None or name in self.only

    def tensors(self, model, optimizer):
        for name, kind, tensor in state_tensors(model, optimizer, only=self.only):
            if kind == PARAM or self.moments:
                yield name, kind, tensor


# Replicas hand over read-once pieces in buckets this big: small enough that the first one goes
# out early in a read, large enough that a load is a few dozen collectives, not hundreds.
BROADCAST_BUCKET_BYTES = 16 * 2**20


@dataclass(frozen=True, slots=True)
class SharedPiece:
    """A piece this rank holds identically with the other members of its replica group, which a
    read-once load reads once and hands over along `handover_dims`."""

    target: Target
    tensor: torch.Tensor  # the state tensor (a DTensor's local shard is taken when handed over)
    handover_dims: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BandedPiece:
    """This rank's column slice of a banded tensor (`plans/checkpoint/column_bands.py`): its
    hand-over group (`dims`) reads the band's whole rows once, block by block, and every member
    takes its columns of each block (docs/decisions.md 146)."""

    target: Target
    tensor: torch.Tensor  # this rank's local tensor
    dims: tuple[str, ...]
    band: tuple[tuple[int, ...], tuple[int, ...]]
    regions: tuple  # every member's (offsets, sizes), by member index (= group rank)
    blocks: tuple[BandBlock, ...]
    share: Target | None  # the rows of the band this rank reads (its blocks, back to back), if any
    staging: torch.Tensor | None  # where it reads them


@dataclass(frozen=True)
class LoadTargets:
    """What a rank's load fills: `destinations`, what this rank reads itself; `shared`, the pieces
    it holds with its replicas (every member lists them in the same order); `readers`, the global
    rank that reads each shared piece (this rank's own are among the destinations); `banded`, its
    column slices that its tp group reads as whole rows once (their blocks this rank reads are
    among the destinations)."""

    destinations: dict[Target, Destination]
    shared: list[SharedPiece]
    readers: list[int]
    banded: list[BandedPiece] = ()


@torch.no_grad()
@collector_paused()
def load_rank_shard(model, optimizer, checkpoint_url: str, all_parameter_names: set[str],
                    manifest: bytes | None = None, handover: HandoverGroups | None = None,
                    only: frozenset[str] | None = None, moments: bool = True) -> dict:
    """Fill this rank's params and AdamW state from a checkpoint written by any layout.

    all_parameter_names: every parameter of the whole model the checkpoint should hold (not only
    this rank's stage), so a key is 'unexpected' only if no rank of the model could own it.
    only: the parameters this load fills (their role: the stored ones of a run's checkpoint, the
    frozen ones from a LoRA run's base); None: every parameter. moments: fill AdamW moments too
    (a base's weights are loaded without them).
    manifest: the manifest's bytes when the caller fetched them already (else read here).
    handover: the trainer's process groups for read-once hand-overs (made here if not given).
    """
    layout, coords = rank_layout(model)
    # Decided from the URL and the layout alone, so the same on every rank: all of them then take
    # part in the hand-over and in both agreements below, whatever fails where.
    # A tp group hands over too: the column slices of banded weights (decision 146).
    hands_over = read_once_for(checkpoint_url) and (layout.dp > 1 or layout.tp > 1)
    device = next((local_tensor(t).device for _, _, t in state_tensors(model, optimizer)), torch.device("cpu"))
    seconds: dict = {}
    scope = LoadScope(only, moments)
    try:
        step, metadata, stored, targets = _prepare_load(
            model, optimizer, checkpoint_url, all_parameter_names, manifest, hands_over, (layout, coords), seconds, scope)
    except Exception as error:
        if not hands_over:
            raise
        _raise_if_any_rank_failed(error, device, checkpoint_url, "before reading")  # raises `error` here
    if hands_over:
        # A rank of another stage may have failed before reading (its stage's keys do not match,
        # its manifest could not be fetched): nobody starts broadcasts it will never join.
        _raise_if_any_rank_failed(None, device, checkpoint_url, "before reading")
        groups = (handover or HandoverGroups()).groups_for(layout)
        stats, received, failure = _read_and_hand_over(stored, targets, groups, layout, coords, seconds)
        # A replica group may span dp and tp, and a rank whose pieces came from a failed reader
        # holds garbage: every rank learns whether any read failed.
        _raise_if_any_rank_failed(failure, device, checkpoint_url, "reading its share of the checkpoint")
    else:
        started, received = time.perf_counter(), 0
        stats = stored.read(targets.destinations)
        seconds["read"] = time.perf_counter() - started
    if ties_embeddings(model):  # only a tied embedding's copy can be held twice by one rank
        _fill_local_copies(model, optimizer, scope)
    # Parts of chunks this rank read but could not verify alone: the caller gathers every rank's
    # and checks them together (`check_loaded_parts`).
    return {"step": step, "metadata": metadata, "bytes_received": received, "seconds": seconds,
            "partial_reads": stored.take_partial_reads(), **stats}


def _prepare_load(model, optimizer, checkpoint_url: str, all_parameter_names: set[str], manifest: bytes | None,
                  hands_over: bool, placement: tuple[ParallelLayout, RankCoords], seconds: dict,
                  scope: LoadScope | None = None):
    """The manifest, the model check, AdamW state ready to be filled, and what this rank reads."""
    started = time.perf_counter()
    chunks, metadata = read_manifest(checkpoint_url, manifest)
    seconds["manifest"] = time.perf_counter() - started
    # Column-wise (a ChunkTable): a record for each tensor's first chunk, not one per chunk.
    first_chunk: dict[tuple[str, str], Chunk] = chunks.first_of_each_tensor()
    scope = scope or LoadScope()
    check_matches(model, first_chunk, all_parameter_names, checkpoint_url, scope)
    step = int(metadata["step"])
    for name, param in model.named_parameters():  # AdamW state must exist before it can be filled
        if not scope.moments or not scope.fills(name):
            continue
        state = optimizer.state.get(param, {})
        # Every element is overwritten (coverage is proven), so existing moments are reused and
        # new ones need no zero fill.
        moments = {kind: state[kind] if kind in state and state[kind].shape == param.shape and state[kind].dtype == param.dtype
                   else torch.empty_like(param) for kind in MOMENTS}
        # Fused AdamW keeps its step count on the parameter's device (a GPU's, for a GPU rank).
        optimizer.state[param] = {"step": torch.tensor(float(step), device=param.device), **moments}
    stored = StoredCheckpoint(checkpoint_url, chunks, metadata, keys_checked=True)
    targets = load_destinations(model, optimizer, hands_over, placement, scope,
                                bands=(stored.index, min_segment_bytes_for(stored.fs)) if hands_over else None)
    return step, metadata, stored, targets


def _raise_if_any_rank_failed(failure: BaseException | None, device: torch.device, checkpoint_url: str,
                              when: str) -> None:
    """One all-reduce over every rank: raise this rank's own error, or, if only another rank
    failed, say so (that rank's error names the cause)."""
    failed = torch.tensor([int(failure is not None)], device=device)
    dist.all_reduce(failed)
    if failure is not None:
        raise failure
    if failed.item():
        raise CheckpointError(f"{checkpoint_url}: a replica of this rank could not load ({when}; its own error names "
                              "the cause); the load failed and this rank's state is incomplete")


def _read_and_hand_over(stored: StoredCheckpoint, targets: LoadTargets, groups: dict[tuple[str, ...], object],
                        layout: ParallelLayout, coords: RankCoords, seconds: dict) -> tuple[dict, int, BaseException | None]:
    """Read this rank's targets in a background thread, its share of the replicated pieces first,
    bucket by bucket, while this thread broadcasts each bucket to its replica group as soon as it
    is in place (and receives the others'). Returns (read stats, bytes received, this rank's read
    error).

    A reader whose read fails still takes part in every broadcast (sending what it has), so no
    replica waits on it; the caller then tells all of them that the load failed."""
    shared = targets.shared
    pieces = [HandedPiece(local_tensor(piece.tensor), groups[piece.handover_dims]) for piece in shared]
    phases = [HANDOVER_KINDS.index(piece.handover_dims) for piece in shared]  # the same order on every rank
    readers = list(targets.readers)
    read_as = [piece.target for piece in shared]  # the target each piece is read as, by its reader
    for banded in targets.banded:
        blocks, block_readers, block_targets = _sliced_blocks(banded, groups[banded.dims], layout, coords)
        pieces += blocks
        readers += block_readers
        read_as += block_targets
        phases += [HANDOVER_KINDS.index(banded.dims)] * len(blocks)
    return read_and_hand_over(stored, targets.destinations, pieces, readers, read_as, phases, layout.rank_of(coords),
                              seconds)


def read_and_hand_over(stored: StoredCheckpoint, destinations: dict[Target, Destination],
                       pieces: list[HandedPiece | SlicedPiece], readers: list[int], read_as: list[Target | None],
                       phases: list[int], my_rank: int, seconds: dict,
                       reads_end_before_a_failure: bool = False) -> tuple[dict, int, BaseException | None]:
    """The hand-over itself, for the trainer's ranks and `rayshard.checkpoint.load` alike: read
    `destinations` in a background thread, the targets the pieces are read as (`read_as`, by the
    reader `readers[i]`) first, bucket by bucket, while this thread hands each bucket over as soon
    as it is in place. Every member of a group lists its pieces in the same order, phases as every
    other member does. Returns (read stats, bytes received, this rank's read error).

    reads_end_before_a_failure: a hand-over that fails (a peer gone) raises only once this rank's
    own reads have ended, so none keeps writing into tensors the caller holds on to (the API's).
    The trainer's ranks drop a failed load's tensors with its attempt, and raise at once: a read
    from a silent snapshot keeper would otherwise hold a second recovery up to its own bound."""
    cut = buckets(pieces, readers, BROADCAST_BUCKET_BYTES, phases)
    # A bucket is in place once every target it is cut from is read (a share of a band may span
    # several buckets, and a bucket hold several shares' blocks); targets are read in the order of
    # the first bucket that needs them, each its own group so each reports when done.
    needs: dict[int, set[Target]] = {position: {read_as[index] for index in bucket.members}
                                    for position, bucket in enumerate(cut) if bucket.reader == my_rank}
    buckets_of: dict[Target, list[int]] = {}
    for position, needed in needs.items():
        for target in needed:
            buckets_of.setdefault(target, []).append(position)
    read_order = sorted(buckets_of, key=lambda target: buckets_of[target][0])
    group_of = {target: number for number, target in enumerate(read_order)}
    in_place = [threading.Event() for _ in cut]

    def target_done(number: int) -> None:
        target = read_order[number]
        for position in buckets_of[target]:
            needs[position].discard(target)
            if not needs[position]:
                in_place[position].set()

    outcome: dict = {}
    started = time.perf_counter()

    @torch.no_grad()  # grad mode is per thread: a plain parameter (a norm under tp alone) is filled here
    def read_all() -> None:
        try:
            outcome["stats"] = stored.read(destinations, groups=group_of, group_done=target_done)
        except BaseException as error:  # reported after the hand-over, which must not wait on it
            outcome["error"] = error
        finally:
            seconds["read"] = time.perf_counter() - started
            for event in in_place:
                event.set()

    reader = threading.Thread(target=read_all, name="checkpoint-read", daemon=True)
    reader.start()
    try:
        received = broadcast_pieces(pieces, cut, my_rank, ready=lambda position: in_place[position].wait())
    except BaseException:
        if reads_end_before_a_failure:
            reader.join()
        raise
    reader.join()
    seconds["broadcast_after_read"] = time.perf_counter() - started - seconds["read"]
    return outcome.get("stats", {}), received, outcome.get("error")


def _sliced_blocks(banded: BandedPiece, group, layout: ParallelLayout, coords: RankCoords):
    """A banded piece's blocks as `SlicedPiece`s (every member lists them in the same order), the
    global rank reading each, and the target each is read in (this rank's share, where it reads
    the block; else None)."""
    band_offsets, _ = banded.band
    columns = tuple((offsets[1] - band_offsets[1], offsets[1] - band_offsets[1] + sizes[1])
                    for offsets, sizes in banded.regions)
    local = local_tensor(banded.tensor)
    my_row = banded.target.offsets[0]
    pieces, readers, targets = [], [], []
    me = replica_members(layout, coords, banded.dims)[0]
    for block in banded.blocks:
        if block.reader == me:  # a view of the share this rank reads
            read = banded.staging.narrow(0, block.offsets[0] - banded.share.offsets[0], block.sizes[0])
        else:
            read = torch.empty((), dtype=local.dtype, device=local.device).expand(block.sizes)
        mine = local.narrow(0, block.offsets[0] - my_row, block.sizes[0])
        pieces.append(SlicedPiece(read, group, columns, mine))
        readers.append(replica_rank(layout, coords, banded.dims, block.reader))
        targets.append(banded.share if block.reader == me else None)
    return pieces, readers, targets


# Every kind of replica group a read-once load hands pieces over in (`handover_dims`; ("tp",): a
# banded tensor's tp group without dp replicas), in the order every rank hands them over.
HANDOVER_KINDS = (("dp",), DATA_MESH_DIMS, ("dp", "tp"), STAGE_MESH_DIMS, ("tp",))


class HandoverGroups:
    """This rank's process group for each kind of replica group, made once per process group and
    layout and kept by the trainer for as long as its process group lives (creating a group is a
    collective, too slow to repeat on every load)."""

    def __init__(self):
        # (the default process group, layout) -> {hand-over dims: this rank's group}. Holding the
        # default group keeps its identity from being reused by a later one.
        self._made: dict[tuple, dict[tuple[str, ...], object]] = {}

    def groups_for(self, layout: ParallelLayout) -> dict[tuple[str, ...], object]:
        """Made from the layout alone, so every rank makes the same groups in the same order; a
        kind whose groups equal an earlier kind's (fsdp=1) reuses them."""
        key = (dist.group.WORLD, layout)
        if key not in self._made:
            made, by_members = {}, {}
            for dims in HANDOVER_KINDS:
                members: dict[str, list[int]] = {}
                for rank in range(layout.world_size):
                    members.setdefault(group_salt(dims, layout.coords_of(rank)), []).append(rank)
                enumeration = tuple(sorted(map(tuple, members.values())))
                if all(len(group) == 1 for group in enumeration):
                    continue  # nothing is handed over within a group of one (dp 1, or tp 1)
                if enumeration not in by_members:
                    with recording_group_sockets():
                        by_members[enumeration], _ = dist.new_subgroups_by_enumeration([list(m) for m in enumeration])
                made[dims] = by_members[enumeration]
            self._made[key] = made
        return self._made[key]


def read_once_for(checkpoint_url: str) -> bool:
    """Whether dp replicas read each piece once and broadcast it (object stores, network file
    systems: storage bandwidth is the bottleneck) or each read it (a local disk: page-cache reads
    beat a gloo broadcast; docs/decisions.md 19, figures in bench/RESULTS.md). RAYSHARD_READ_ONCE=1/0 overrides."""
    setting = os.environ.get("RAYSHARD_READ_ONCE", "auto").strip().lower()
    if setting in ("1", "true", "yes"):
        return True
    if setting in ("0", "false", "no"):
        return False
    backend, _ = open_url(checkpoint_url)
    return not backend.local_paths


def _fill_local_copies(model, optimizer, scope: LoadScope | None = None) -> None:
    """Tensors this rank holds twice under one name and region (with the V placement, rank 0
    runs both the first stage and the last one's tied copy): the copy takes the loaded values."""
    first: dict[tuple, torch.Tensor] = {}
    for name, kind, tensor in (scope or LoadScope()).tensors(model, optimizer):
        key = (name, kind, local_region(tensor))
        if key in first:
            if tensor is not first[key]:
                local_tensor(tensor).copy_(local_tensor(first[key]))
        else:
            first[key] = tensor


def load_destinations(model, optimizer, read_once: bool = True,
                      placement: tuple[ParallelLayout, RankCoords] | None = None,
                      scope: LoadScope | None = None, bands: tuple | None = None) -> LoadTargets:
    """What this rank fills on load, and which of it it reads itself.

    read_once: each replica group (`handover_dims`: dp, and tp or fsdp where a piece is copied
    there too) reads its pieces once, split by bytes as on save, and broadcasts them, so storage
    serves the checkpoint once, not once per replica. placement: this rank's `rank_layout`, if
    the caller has it (reading it walks every parameter's mesh). bands: (the checkpoint's
    `ChunkIndex`, the store's min_segment_bytes) to band row-parallel weights whose column slices
    the store would read as whole rows (`_banded`); None: no banding."""
    layout, coords = placement or rank_layout(model)
    destinations, shared, seen, banded = {}, [], set(), []
    hand_over = read_once and layout.dp > 1
    for name, kind, tensor in (scope or LoadScope()).tensors(model, optimizer):
        offsets, sizes = local_region(tensor)
        if (name, kind, offsets) in seen:
            continue  # a second copy on this rank (a tied embedding's, V placement): filled after the read
        seen.add((name, kind, offsets))
        target = Target(name, kind, offsets, sizes)
        band = _banded(target, tensor, layout, coords, *bands) if read_once and bands and layout.tp > 1 else None
        if band is not None:
            banded.append(band)
            if band.share is not None:
                destinations[band.share] = Destination(band.staging, band.share.offsets)
            continue
        dims = handover_dims(replicated_dims(tensor, layout)) if hand_over and isinstance(tensor, DTensor) else ()
        if dims and all(sizes):
            shared.append(SharedPiece(target, tensor, dims))
        else:
            destinations[target] = Destination(local_tensor(tensor), offsets)
    locals_ = [local_tensor(piece.tensor) for piece in shared]
    readers = assign_readers([piece.handover_dims for piece in shared],
                             [t.numel() * t.element_size() for t in locals_], layout, coords)
    my_rank = layout.rank_of(coords)
    for piece, local, reader in zip(shared, locals_, readers):
        if reader == my_rank:
            destinations[piece.target] = Destination(local, piece.target.offsets)
    return LoadTargets(destinations, shared, readers, banded)


def _banded(target: Target, tensor: torch.Tensor, layout: ParallelLayout, coords: RankCoords, index,
            min_segment_bytes: int) -> BandedPiece | None:
    """This piece as a banded one, if its tp group's regions form a band (`band_of`) that some member
    would over-read alone (`worth_banding`): the group is the tp ranks, with their dp replicas
    when dp > 1 (every member computes the same blocks from the same regions and chunks)."""
    if (not isinstance(tensor, DTensor) or len(target.sizes) < 2 or "tp" not in (tensor.device_mesh.mesh_dim_names or ())
            or (target.name, target.kind) not in index):
        return None
    mesh = tensor.device_mesh
    tp_dim = mesh.mesh_dim_names.index("tp")
    coordinate = list(mesh.get_coordinate())
    dims = ("dp", "tp") if layout.dp > 1 else ("tp",)
    _, members = replica_members(layout, coords, dims)
    regions = []
    for member in range(members):
        coordinate[tp_dim] = layout.coords_of(replica_rank(layout, coords, dims, member)).tp
        regions.append(region_at(tuple(tensor.shape), tuple(mesh.shape), list(coordinate), tensor.placements))
    band = band_of(regions)
    if band is None or not worth_banding(index[(target.name, target.kind)].overlapping(*band), regions, band,
                                         min_segment_bytes):
        return None
    local = local_tensor(tensor)
    blocks = split_band(band, members, local.element_size(), BAND_BLOCK_BYTES, target.name)
    share = reader_shares(blocks).get(replica_members(layout, coords, dims)[0])
    if share is None:  # a band of fewer rows than members: this one reads nothing
        return BandedPiece(target, tensor, dims, band, tuple(regions), tuple(blocks), None, None)
    staging = torch.empty(share[1], dtype=local.dtype, device=local.device)
    return BandedPiece(target, tensor, dims, band, tuple(regions), tuple(blocks),
                       Target(target.name, target.kind, *share), staging)


def check_matches(model, stored: dict[tuple[str, str], Chunk], all_parameter_names: set[str], where: str,
                  scope: LoadScope | None = None) -> None:
    """One error listing every missing key, unexpected key and shape or dtype mismatch."""
    scope = scope or LoadScope()
    kinds = (PARAM, *MOMENTS) if scope.moments else (PARAM,)
    expected = {}
    for name, param in model.named_parameters():
        if not scope.fills(name):
            continue
        described = (tuple(param.shape), dtype_name(param.dtype))  # once: DTensor's properties are not free
        expected.update({(name, kind): described for kind in kinds})
    possible = {(name, kind) for name in all_parameter_names for kind in (PARAM, *MOMENTS)}
    found = {key: (chunk.global_shape, chunk.dtype) for key, chunk in stored.items()}
    raise_if_mismatched(expected, found, possible, where)
