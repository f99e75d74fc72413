"""A rank's side of checkpoints: which pieces it writes, and how it fills its shard on load.

Layout-free in both directions: a piece is written with its global name and region by exactly one
of the ranks holding it, and a load reads, for each local piece, only the byte ranges of stored
chunks that overlap it — so any layout can load what any other layout wrote.

Which replica writes is decided here, not by `actors.model.shards.is_primary_replica` (the grad-norm's
rule, which always picks coordinate 0): each replica group splits its pieces by bytes
(`plans/checkpoint/writers.py`), so dp replicas share the writing instead of replica 0 writing everything.
"""
from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections import Counter
from collections.abc import Callable

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem
from torch.distributed.tensor import DTensor, Replicate

from actors.checkpoint.io import WINDOW_BYTES, decode_manifest, dtype_name, execute_requests, write_shard
from actors.checkpoint.partial_reads import PartialRead, check_partial_reads, mismatch_error
from actors.model import shards
from actors.checkpoint.replica_broadcast import broadcast_pieces, buckets
from actors.model.shards import local_region
from plans.checkpoint.chunks import EXP_AVG, EXP_AVG_SQ, PARAM, Chunk
from plans.errors import CheckpointError
from plans.layout.parallel_layout import ParallelLayout, RankCoords
from plans.checkpoint.model_check import raise_if_mismatched
from plans.checkpoint.object_keys import check_object_keys
from plans.checkpoint.reshard import ReadItem, Target, header_checks, index_chunks, plan_rank
from plans.checkpoint.writers import assign_readers, assign_writers, file_position, group_salt, handover_dims
from plans.checkpoint.regions import EMBEDDING, replica_members

MANIFEST = "manifest.parquet"
MOMENTS = (EXP_AVG, EXP_AVG_SQ)
# Replicas hand over read-once pieces in buckets this big: small enough that the first one goes
# out early in a read, large enough that a load is a few dozen collectives, not hundreds.
BROADCAST_BUCKET_BYTES = 16 * 2**20
DATA_DIMS = ("dp", "fsdp", "tp")


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """(global name, kind, tensor) for every piece of training state: params and AdamW moments."""
    for name, param in model.named_parameters():
        yield name, PARAM, param
        state = optimizer.state.get(param, {})
        for kind in MOMENTS:
            if kind in state:
                yield name, kind, state[kind]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (what `to_local()` returns a view of). `to_local()` runs an
    autograd Function, ~28 us a call: a tenth of a small local load went to the ~150 calls."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def rank_layout(model: torch.nn.Module) -> tuple[ParallelLayout, RankCoords]:
    """This rank's layout and coordinates, read off the DTensor meshes and the process group
    (degrees no mesh shows are 1: FSDP and TP turn every parameter they touch into a DTensor)."""
    sizes = {dim: 1 for dim in DATA_DIMS}
    for param in model.parameters():
        if isinstance(param, DTensor):
            for dim, size in zip(param.device_mesh.mesh_dim_names or (), param.device_mesh.shape):
                if dim in sizes:
                    sizes[dim] = size
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = ParallelLayout(pp=max(1, world // (sizes["dp"] * sizes["fsdp"] * sizes["tp"])), **sizes)
    return layout, layout.coords_of(rank)


def replicated_dims(tensor: torch.Tensor, layout: ParallelLayout) -> tuple[str, ...]:
    """Mesh dims along which other ranks hold an identical copy of this rank's piece: the tensor's
    Replicate dims, and every data/tensor-parallel dim its mesh does not cover (a norm weight under
    TP without FSDP is a plain tensor copied on every tp rank)."""
    covered, copies = set(), set()
    if isinstance(tensor, DTensor):
        for dim, placement in zip(tensor.device_mesh.mesh_dim_names, tensor.placements):
            covered.add(dim)
            if isinstance(placement, Replicate):
                copies.add(dim)
    copies |= {dim for dim in DATA_DIMS if dim not in covered}
    return tuple(dim for dim in ("pp", *DATA_DIMS) if dim in copies and getattr(layout, dim) > 1)


def _ties_embeddings(model) -> bool:
    if hasattr(model, "tie_embeddings"):  # the pipeline's view of a rank's stages
        return bool(model.tie_embeddings)
    return bool(getattr(getattr(model, "config", None), "tie_embeddings", False))


def _is_pipeline_copy(tensor: torch.Tensor) -> bool:
    """The trainer marks the last stage's copy of a tied embedding (and its moments)."""
    mark = getattr(shards, "PIPELINE_COPY", None)
    return bool(mark and getattr(tensor, mark, False))


def pieces_to_write(model, optimizer) -> list[tuple[str, str, torch.Tensor, tuple, tuple]]:
    """This rank's share of the writing: (name, kind, local tensor, global shape, global offsets)."""
    layout, coords = rank_layout(model)
    tied = _ties_embeddings(model)
    candidates = []
    for name, kind, tensor in state_tensors(model, optimizer):
        offsets, sizes = local_region(tensor)
        if not all(sizes) and sizes:
            continue  # an empty FSDP shard (more shards than rows)
        if _is_pipeline_copy(tensor) or (tied and name == EMBEDDING and coords.pp != 0):
            continue  # the last stage's copy of the tied embedding: the first stage writes it
        candidates.append((name, kind, _local(tensor), tuple(tensor.shape), offsets, replicated_dims(tensor, layout)))
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, candidate in enumerate(candidates):
        groups.setdefault(candidate[5], []).append(index)
    chosen = [True] * len(candidates)
    for dims, members in groups.items():
        if not dims:
            continue
        mine, size = replica_members(layout, coords, dims)
        nbytes = [candidates[i][2].numel() * candidates[i][2].element_size() for i in members]
        for index, writer in zip(members, assign_writers(nbytes, size, group_salt(dims, coords))):
            chosen[index] = writer == mine
    mine = [c for c, keep in zip(candidates, chosen) if keep]
    return [c[:5] for c in sorted(mine, key=lambda c: file_position(c[5]))]


def save_rank_shard(model, optimizer, coords: dict[str, int], checkpoint_url: str, file: str) -> list[dict]:
    """Stream this rank's share of the pieces to checkpoint_url/file; return their manifest rows.
    `coords` is accepted for the caller's convenience; the rank's position is read off its meshes."""
    pieces = pieces_to_write(model, optimizer)
    if not pieces:
        return []
    fs, base = fsspec.core.url_to_fs(checkpoint_url)
    return [chunk.to_row() for chunk in write_shard(fs, base, file, pieces)]


def manifest_bytes(checkpoint_url: str) -> bytes:
    """The committed manifest's bytes, as stored (a driver fetches them once and hands them to
    every rank of a load, instead of every rank fetching them)."""
    fs, base = fsspec.core.url_to_fs(checkpoint_url)
    try:
        return fs.cat_file(f"{base}/{MANIFEST}")
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint_url}/{MANIFEST} does not exist: not a committed checkpoint") from None


def read_manifest(checkpoint_url: str, data: bytes | None = None) -> tuple[list[Chunk], dict]:
    """The chunks and metadata of a committed checkpoint (data: its manifest's bytes, if already
    fetched). Every path that opens a checkpoint for reading (loads, resume, offline reshard,
    digest, diff, export, verify, gc) comes through here, so this is where a manifest naming
    objects outside its own directory (`..`, absolute paths, other buckets) is refused, before
    any shard byte is fetched."""
    where = f"{checkpoint_url}/{MANIFEST}"
    chunks, metadata = decode_manifest(manifest_bytes(checkpoint_url) if data is None else data, where)
    check_object_keys((chunk.file for chunk in chunks), checkpoint_url)
    return chunks, metadata


class StoredCheckpoint:
    """A committed checkpoint opened for reading: its chunks indexed once, then any number of
    planned reads. The one read path shared by training loads, the offline reshard, the digest
    and the exporters."""

    def __init__(self, url: str, chunks: list[Chunk] | None = None, metadata: dict | None = None,
                 keys_checked: bool = False):
        """keys_checked: the chunks came from `read_manifest` (which checks their object keys)."""
        if chunks is None:
            chunks, metadata = read_manifest(url)
        elif not keys_checked:  # chunks decoded elsewhere get the same check as read_manifest's
            check_object_keys((chunk.file for chunk in chunks), url)
        self.url, self.chunks, self.metadata = url, chunks, metadata or {}
        self.partial_reads: list[PartialRead] = []  # parts of chunks read and not yet verified
        self.index = index_chunks(chunks)
        # Header ranges come from all of a file's chunks (everything before its first one).
        self.headers = header_checks(chunks)
        self.fs, self.base = fsspec.core.url_to_fs(url)

    def tensors(self) -> dict[tuple[str, str], list[Chunk]]:
        return {key: index.chunks for key, index in self.index.items()}

    def plan(self, targets, window_bytes: int = WINDOW_BYTES):
        # Requests up to the whole window: fewer, larger GETs measured faster on the S3 server we
        # test against, which reads a whole object for every ranged GET (docs/decisions.md 35).
        return plan_rank(self.index, list(targets), headers=self.headers, max_request_bytes=window_bytes)

    def read(self, destinations: dict[Target, tuple[torch.Tensor, tuple]], window_bytes: int = WINDOW_BYTES,
             groups: dict[Target, int] | None = None, group_done: Callable[[int], None] | None = None) -> dict:
        """Plan and execute the reads that fill every target (name, kind, region) into its tensor.

        groups: target -> group number; the groups' reads go first, lowest number first, and
        group_done(number) is called as soon as every target of that group is verified and in
        place (a read-once load hands a group to its replicas while it reads the next)."""
        plan = self.plan(destinations, window_bytes)
        by_item = {item: destinations[target] for target, items in plan.items.items() for item in items}
        requests, served = plan.requests, None
        if groups:
            requests, served = _group_order(plan, groups, group_done)
        bytes_read = execute_requests(self.fs, self.base, requests, by_item, window_bytes, served, self.partial_reads)
        return {"bytes_read": bytes_read, "bytes_needed": plan.bytes_needed, "requests": len(plan.requests),
                "files": plan.files}

    def take_partial_reads(self) -> list[PartialRead]:
        """The parts of chunks read since the last call, to verify where all of a chunk's parts
        meet (`check_partial_reads`)."""
        reads, self.partial_reads = self.partial_reads, []
        return reads

    def check_partial_reads(self) -> int:
        """Verify the chunks this process read in parts (`verify_parts`)."""
        return verify_parts(self.take_partial_reads(), self.url, lambda: self)

    def read_chunk_whole(self, part: PartialRead) -> None:
        """Read the chunk a part belongs to whole, which checks its checksum as it lands."""
        chunk = next(c for c in self.index[(part.name, part.kind)].chunks
                     if (c.file, c.byte_start) == (part.file, part.chunk_start))
        self.read_region(chunk.name, chunk.kind, chunk.offsets, chunk.sizes)

    def read_region(self, name: str, kind: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        """A fresh CPU tensor holding one region of one stored tensor."""
        chunk = self.index[(name, kind)].chunks[0]
        tensor = torch.empty(sizes, dtype=getattr(torch, chunk.dtype))
        self.read({Target(name, kind, tuple(offsets), tuple(sizes)): (tensor, tuple(offsets))})
        return tensor


@contextlib.contextmanager
def _collector_paused():
    """A load allocates thousands of small objects (chunks, plans, read items) in a process whose
    heap holds a whole model's module tree; the cyclic collector's full passes over that heap
    took ~40% of a small local load (cProfile, dp2 x tp2, small preset). Nothing a load makes is
    cyclic garbage, so the collector waits until it is done."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@torch.no_grad()
@_collector_paused()
def load_rank_shard(model, optimizer, checkpoint_url: str, all_parameter_names: set[str],
                    manifest: bytes | None = None) -> dict:
    """Fill this rank's params and AdamW state from a checkpoint written by any layout.

    all_parameter_names: every parameter of the whole model (not only this rank's stage), so a
    key is 'unexpected' only if no rank of the model could own it.
    manifest: the manifest's bytes when the caller fetched them already (else read here).
    """
    layout, coords = rank_layout(model)
    # Decided from the URL and the layout alone, so the same on every rank: all of them then take
    # part in the hand-over and in both agreements below, whatever fails where.
    hands_over = read_once_for(checkpoint_url) and layout.dp > 1
    device = next((_local(t).device for _, _, t in state_tensors(model, optimizer)), torch.device("cpu"))
    seconds: dict = {}
    try:
        step, metadata, stored, destinations, shared, readers = _prepare_load(
            model, optimizer, checkpoint_url, all_parameter_names, manifest, hands_over, (layout, coords), seconds)
    except Exception as error:
        if not hands_over:
            raise
        _raise_if_any_rank_failed(error, device, checkpoint_url, "before reading")  # raises `error` here
    if hands_over:
        # A rank of another stage may have failed before reading (its stage's keys do not match,
        # its manifest could not be fetched): nobody starts broadcasts it will never join.
        _raise_if_any_rank_failed(None, device, checkpoint_url, "before reading")
        stats, received, failure = _read_and_hand_over(stored, destinations, shared, readers, layout, coords, seconds)
        # A replica group may span dp and tp, and a rank whose pieces came from a failed reader
        # holds garbage: every rank learns whether any read failed.
        _raise_if_any_rank_failed(failure, device, checkpoint_url, "reading its share of the checkpoint")
    else:
        started, received = time.perf_counter(), 0
        stats = stored.read(destinations)
        seconds["read"] = time.perf_counter() - started
    if _ties_embeddings(model):  # only a tied embedding's copy can be held twice by one rank
        _fill_local_copies(model, optimizer)
    # Parts of chunks this rank read but could not verify alone: the caller gathers every rank's
    # and checks them together (`check_loaded_parts`).
    return {"step": step, "metadata": metadata, "bytes_received": received, "seconds": seconds,
            "partial_reads": stored.take_partial_reads(), **stats}


def _prepare_load(model, optimizer, checkpoint_url: str, all_parameter_names: set[str], manifest: bytes | None,
                  hands_over: bool, placement: tuple[ParallelLayout, RankCoords], seconds: dict):
    """The manifest, the model check, AdamW state ready to be filled, and what this rank reads."""
    started = time.perf_counter()
    chunks, metadata = read_manifest(checkpoint_url, manifest)
    seconds["manifest"] = time.perf_counter() - started
    first_chunk: dict[tuple[str, str], Chunk] = {}
    for chunk in chunks:
        first_chunk.setdefault((chunk.name, chunk.kind), chunk)
    check_matches(model, first_chunk, all_parameter_names, checkpoint_url)
    step = int(metadata["step"])
    for param in model.parameters():  # AdamW state must exist before it can be filled
        state = optimizer.state.get(param, {})
        # Every element is overwritten (coverage is proven), so existing moments are reused and
        # new ones need no zero fill.
        moments = {kind: state[kind] if kind in state and state[kind].shape == param.shape and state[kind].dtype == param.dtype
                   else torch.empty_like(param) for kind in MOMENTS}
        optimizer.state[param] = {"step": torch.tensor(float(step)), **moments}
    destinations, shared, readers = load_destinations(model, optimizer, hands_over, placement)
    stored = StoredCheckpoint(checkpoint_url, chunks, metadata, keys_checked=True)
    return step, metadata, stored, destinations, shared, readers


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


def _read_and_hand_over(stored: StoredCheckpoint, destinations: dict, shared: list, readers: list[int],
                        layout: ParallelLayout, coords: RankCoords, seconds: dict) -> tuple[dict, int, BaseException | None]:
    """Read this rank's targets in a background thread, its share of the replicated pieces first,
    bucket by bucket, while this thread broadcasts each bucket to its replica group as soon as it
    is in place (and receives the others'). Returns (read stats, bytes received, this rank's read
    error).

    A reader whose read fails still takes part in every broadcast (sending what it has), so no
    replica waits on it; the caller then tells all of them that the load failed."""
    groups = handover_groups(layout)
    pieces = [(_local(tensor), groups[dims]) for _, _, tensor, _, _, dims in shared]
    phases = [HANDOVER_KINDS.index(dims) for *_, dims in shared]  # the same order on every rank
    my_rank = layout.rank_of(coords)
    cut = buckets(pieces, readers, BROADCAST_BUCKET_BYTES, phases)
    position_of = {Target(*shared[index][:2], shared[index][3], shared[index][4]): position
                   for position, bucket in enumerate(cut) if bucket.reader == my_rank for index in bucket.members}
    in_place = [threading.Event() for _ in cut]
    outcome: dict = {}
    started = time.perf_counter()

    def read_all() -> None:
        try:
            outcome["stats"] = stored.read(destinations, groups=position_of, group_done=lambda p: in_place[p].set())
        except BaseException as error:  # reported after the hand-over, which must not wait on it
            outcome["error"] = error
        finally:
            seconds["read"] = time.perf_counter() - started
            for event in in_place:
                event.set()

    reader = threading.Thread(target=read_all, name="checkpoint-read", daemon=True)
    reader.start()
    received = broadcast_pieces(pieces, cut, my_rank, ready=lambda position: in_place[position].wait())
    reader.join()
    seconds["broadcast_after_read"] = time.perf_counter() - started - seconds["read"]
    return outcome.get("stats", {}), received, outcome.get("error")


# Every kind of replica group a read-once load hands pieces over in (`handover_dims`), in the
# order every rank broadcasts them.
HANDOVER_KINDS = (("dp",), ("dp", "fsdp"), ("dp", "tp"), ("dp", "fsdp", "tp"))
# (the default process group, layout) -> {hand-over dims: this rank's group}. Holding the default
# group keeps its identity from being reused by a later one (an elastic restart makes a new one).
_HANDOVER_GROUPS: dict[tuple, dict[tuple[str, ...], object]] = {}


def handover_groups(layout: ParallelLayout) -> dict[tuple[str, ...], object]:
    """This rank's process group for each kind of replica group. Made once per process group,
    from the layout alone, so every rank makes the same groups in the same order (creating a
    group is a collective); a kind whose groups equal an earlier kind's (fsdp=1) reuses them."""
    key = (dist.group.WORLD, layout)
    if key not in _HANDOVER_GROUPS:
        made, by_members = {}, {}
        for dims in HANDOVER_KINDS:
            members: dict[str, list[int]] = {}
            for rank in range(layout.world_size):
                members.setdefault(group_salt(dims, layout.coords_of(rank)), []).append(rank)
            enumeration = tuple(sorted(map(tuple, members.values())))
            if enumeration not in by_members:
                by_members[enumeration], _ = dist.new_subgroups_by_enumeration([list(m) for m in enumeration])
            made[dims] = by_members[enumeration]
        _HANDOVER_GROUPS[key] = made
    return _HANDOVER_GROUPS[key]


def forget_handover_groups() -> None:
    """Before a reused process joins a new process group: drop the old one's groups."""
    _HANDOVER_GROUPS.clear()


def _group_order(plan, groups: dict[Target, int], group_done: Callable[[int], None]):
    """The plan's requests with the groups' first (lowest group first), and the per-item
    callback that reports each group once all of its targets are in place."""
    target_of = {item: target for target, items in plan.items.items() for item in items}
    items_left = {target: len(items) for target, items in plan.items.items()}
    targets_left = Counter(groups[target] for target in plan.items if target in groups)
    after_groups = max(groups.values(), default=0) + 1

    def order(request) -> int:
        return min((groups.get(target_of[part], after_groups) for part in request.parts if isinstance(part, ReadItem)),
                   default=-1)  # header-only requests first: they are small

    def served(item) -> None:
        target = target_of[item]
        items_left[target] -= 1
        if items_left[target] == 0 and target in groups:
            group = groups[target]
            targets_left[group] -= 1
            if targets_left[group] == 0:
                group_done(group)

    return sorted(plan.requests, key=order), served


def read_once_for(checkpoint_url: str) -> bool:
    """Whether dp replicas read each piece once and broadcast it (object stores, network file
    systems: storage bandwidth is the bottleneck) or each read it (a local disk: page-cache reads
    beat a gloo broadcast; measured in docs/decisions.md). RAYSHARD_READ_ONCE=1/0 overrides."""
    setting = os.environ.get("RAYSHARD_READ_ONCE", "auto").strip().lower()
    if setting in ("1", "true", "yes"):
        return True
    if setting in ("0", "false", "no"):
        return False
    fs, _ = fsspec.core.url_to_fs(checkpoint_url)
    return not isinstance(fs, LocalFileSystem)


def _fill_local_copies(model, optimizer) -> None:
    """Tensors this rank holds twice under one name and region (with the V placement, rank 0
    runs both the first stage and the last one's tied copy): the copy takes the loaded values."""
    first: dict[tuple, torch.Tensor] = {}
    for name, kind, tensor in state_tensors(model, optimizer):
        key = (name, kind, local_region(tensor))
        if key in first:
            if tensor is not first[key]:
                _local(tensor).copy_(_local(first[key]))
        else:
            first[key] = tensor


def load_destinations(model, optimizer, read_once: bool = True,
                      placement: tuple[ParallelLayout, RankCoords] | None = None):
    """(what this rank reads: target -> (local tensor, its global offsets), the pieces shared with
    replicas as (name, kind, tensor, offsets, sizes, hand-over dims), and the global rank that
    reads each shared piece).

    read_once: each replica group (`handover_dims`: dp, and tp or fsdp where a piece is copied
    there too) reads its pieces once, split by bytes as on save, and broadcasts them, so storage
    serves the checkpoint once, not once per replica. placement: this rank's `rank_layout`, if
    the caller has it (reading it walks every parameter's mesh)."""
    layout, coords = placement or rank_layout(model)
    destinations, shared, seen = {}, [], set()
    hand_over = read_once and layout.dp > 1
    for name, kind, tensor in state_tensors(model, optimizer):
        offsets, sizes = local_region(tensor)
        if (name, kind, offsets) in seen:
            continue  # a second copy on this rank (a tied embedding's, V placement): filled after the read
        seen.add((name, kind, offsets))
        dims = handover_dims(replicated_dims(tensor, layout)) if hand_over and isinstance(tensor, DTensor) else ()
        if dims and all(sizes):
            shared.append((name, kind, tensor, offsets, sizes, dims))
        else:
            destinations[Target(name, kind, offsets, sizes)] = (_local(tensor), offsets)
    readers = assign_readers([dims for *_, dims in shared],
                             [_local(t).numel() * _local(t).element_size() for _, _, t, _, _, _ in shared], layout, coords)
    my_rank = layout.rank_of(coords)
    for (name, kind, tensor, offsets, sizes, _), reader in zip(shared, readers):
        if reader == my_rank:
            destinations[Target(name, kind, offsets, sizes)] = (_local(tensor), offsets)
    return destinations, shared, readers


def check_matches(model, stored: dict[tuple[str, str], Chunk], all_parameter_names: set[str], where: str) -> None:
    """One error listing every missing key, unexpected key and shape or dtype mismatch."""
    kinds = (PARAM, *MOMENTS)
    expected = {}
    for name, param in model.named_parameters():
        described = (tuple(param.shape), dtype_name(param.dtype))  # once: DTensor's properties are not free
        expected.update({(name, kind): described for kind in kinds})
    possible = {(name, kind) for name in all_parameter_names for kind in kinds}
    found = {key: (chunk.global_shape, chunk.dtype) for key, chunk in stored.items()}
    raise_if_mismatched(expected, found, possible, where)


def verify_parts(reads: list[PartialRead], checkpoint_url: str, opened: Callable[[], StoredCheckpoint]) -> int:
    """Verify chunks read in parts, by one process or gathered from every rank that read some: the
    parts of each chunk combine to its checksum. A chunk whose parts do not cover it exactly (a
    rank's read failed or was skipped) is read whole, from `opened()`. Raises a CheckpointError
    naming every chunk that fails; returns how many chunks were verified."""
    outcome = check_partial_reads(reads)
    if outcome.mismatched:
        raise mismatch_error(outcome.mismatched, checkpoint_url)
    if outcome.untiled:
        stored = opened()
        for part in outcome.untiled:
            stored.read_chunk_whole(part)
    return outcome.verified + len(outcome.untiled)


def check_loaded_parts(checkpoint_url: str, results: list[dict], manifest: bytes | None = None) -> int:
    """After every rank of a load returned: verify the chunks they read in parts, together. The
    checkpoint is opened (its manifest decoded) only if some chunk must be read whole."""
    reads = [read for result in results for read in result.get("partial_reads", ())]
    return verify_parts(reads, checkpoint_url,
                        lambda: StoredCheckpoint(checkpoint_url, *read_manifest(checkpoint_url, manifest), keys_checked=True))
