"""`rayshard.checkpoint`: save and load a state dict from any torch.distributed program, shaped
like torch DCP's `save` / `async_save` / `load`, with rayshard's commit and layout-free reads.

    ref = rayshard.checkpoint.save(state_dict, "s3://bucket/runs/my-run", step=20)
    future = rayshard.checkpoint.async_save(state_dict, "./runs/my-run", step=30)  # .result() -> ref
    rayshard.checkpoint.load(state_dict, "./runs/my-run")        # LATEST; "...@20" for a step
    print(rayshard.checkpoint.plan(state_dict, "./runs/my-run").describe())

Every rank of the process group (the world by default, or no process group at all) calls the
same function with its own state dict. A save is: each rank lists what it holds; the first rank
takes the run's writer lease, opens an attempt (`Store.begin`) and chooses who writes each piece
(every distinct piece once, replicas sharing by bytes: `plans/checkpoint/save_plan.py`); every
rank streams its share into its own file under the attempt (`write_shard`); the first rank commits
the gathered chunks (tiling checked, create-only manifest, compare-and-swap LATEST) and tells the
others. A load is: the first rank resolves the checkpoint and sends its manifest; every rank
reads exactly the byte ranges that overlap its pieces, straight into the state dict's tensors,
checksums verified (`StoredCheckpoint.read`); on an object store, a piece several ranks hold alike
is read by one of them and broadcast, and column slices are read once per group as whole rows
(`mesh_replicas.py`, `mesh_bands.py`); the chunks read in parts are verified together on the
first rank. Exchanges: `actors/checkpoint/coordination.py` (bounded; a failed rank is named).
No Ray anywhere.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import fsspec
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rayshard.actors.checkpoint.collector_paused import collector_paused
from rayshard.actors.checkpoint.coordination import Coordination, Failure, timeout_s
from rayshard.actors.checkpoint.deferred_copy import DeferredCopy, StepGates, is_written_by, optimizers_of, written_by
from rayshard.actors.checkpoint.load import read_and_hand_over, read_once_for
from rayshard.actors.checkpoint.mesh_bands import (MeshBand, agreed_bands, destinations_with_bands, hand_over_lists,
                                                   mesh_bands)
from rayshard.actors.checkpoint.mesh_replicas import (ReplicaPiece, agreed_groups, group_signatures, mesh_replicas,
                                                      with_readers)
from rayshard.actors.checkpoint.shard_writer import Piece, write_shard
from rayshard.actors.checkpoint.staging import HostStaging
from rayshard.actors.checkpoint.state_dict import FlatState, destinations, fill_values, flatten
from rayshard.actors.checkpoint.stored import StoredCheckpoint, min_segment_bytes_for, verify_parts
from rayshard.cluster.api.locations import RunLocation, resolve_checkpoint, run_location
from rayshard.cluster.catalog import leases, writer_lease
from rayshard.cluster.catalog.pending import PendingCheckpoint
from rayshard.cluster.catalog.store import MAX_STEP, CheckpointRef
from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.checkpoint.model_check import check_state_dict_matches
from rayshard.plans.interop.model_description import MANIFEST_KEY as MODEL_DESCRIPTION
from rayshard.plans.interop.model_description import ModelDescription, check_shapes, describe, selected
from rayshard.plans.checkpoint.save_plan import HeldPiece, choose_writers
from rayshard.plans.checkpoint.state_dict_keys import check_json_value
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.storage.manifest_io import manifest_bytes, read_manifest

WRITER = "rayshard.checkpoint"  # the manifest's `writer`: a checkpoint of this API, not of the trainer


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What `load` filled the state dict from: the checkpoint, and the `metadata` it was saved with."""

    url: str
    run: str | None
    step: int
    metadata: dict | None


@dataclass(frozen=True)
class RankPlan:
    """One rank's share of a load (`plan`): bytes it reads (whole rows and chunk headers
    included) and needs, in how many requests to how many files, for how many pieces."""

    rank: int
    pieces: int
    bytes_needed: int
    bytes_read: int
    requests: int
    files: int


@dataclass(frozen=True)
class LoadPlan:
    """A load's dry run: which bytes each rank would read; nothing is read but the manifest."""

    url: str
    step: int
    ranks: list[RankPlan]

    @property
    def bytes_read(self) -> int:
        return sum(rank.bytes_read for rank in self.ranks)

    def describe(self) -> str:
        lines = [f"load of {self.url} (step {self.step}) on {len(self.ranks)} rank(s): "
                 f"{self.bytes_read / 2**20:.2f} MiB read for {sum(r.bytes_needed for r in self.ranks) / 2**20:.2f} MiB needed"]
        lines += [f"  rank {r.rank}: {r.pieces} pieces, {r.bytes_read / 2**20:.2f} MiB in {r.requests} request(s) "
                  f"to {r.files} file(s)" for r in self.ranks]
        return "\n".join(lines)


# ---- save ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Assignment:
    """A rank's share of a save, from the first rank: the checkpoint directory, the file it writes
    there, and the indices of its held pieces that go in it."""

    url: str
    file: str
    indices: list[int]


@dataclass
class _Snapshot:
    """A rank's state as a save writes it: what it holds, and the tensors that hold it (the live
    ones, or host copies for an async save); values and metadata as JSON text."""

    held: list[HeldPiece] = field(default_factory=list)
    tensors: list = field(default_factory=list)
    values: str = "{}"
    user: str = "null"
    mesh: dict = field(default_factory=dict)
    model: ModelDescription | None = None  # what `model=` described, checked and recorded by the first rank


@collector_paused()
def save(state_dict: Mapping, where: str, *, step: int, metadata: dict | None = None,
         process_group=None, model: dict | None = None) -> CheckpointRef:
    """Save `state_dict` as checkpoint `step` of the run `where` (a URL or path; its parent is the
    store) and return the committed reference. A collective: every rank of `process_group` calls
    it. Nothing is visible until the first rank's commit; a process killed meanwhile leaves no
    checkpoint (`rayshard ckpt gc` removes its files).

    model: optionally, the model the state dict holds, so `rayshard ckpt reshard/export/plan` need
    no flag: `{"preset": "tiny"}`, `{"hf_config": <config.json's contents>}` or `{"config":
    <ModelConfig fields>}`, with `"names": "torchtitan"` when the module names are torchtitan's
    Llama (default "rayshard"). Every parameter's shape is checked against it before anything is
    written; it is kept in the manifest as JSON."""
    _wait_for_async_save()
    coordination = Coordination(process_group, _save_name(where, step))
    own, snapshot = None, _Snapshot()
    try:
        snapshot, _ = _snapshot(state_dict, metadata, step, staging=None, model=model)
    except Exception as error:  # reported to every rank at the first exchange
        own = error
    return _save(coordination, where, step, snapshot, own)


def async_save(state_dict: Mapping, where: str, *, step: int, metadata: dict | None = None,
               process_group=None, model: dict | None = None, optimizer=None) -> Future:
    """`save` in the background: returns once this rank's state is copied to host memory (later
    changes to the tensors are not saved); the future's result is the committed `CheckpointRef`,
    or its exception the save's failure. One async save runs at a time per process: a second one
    (or a `save`, `load` or `plan`) first waits for the one in flight. Keep the process group
    alive until the future is done.

    optimizer: the optimizer (or a list of them) whose next `step()` is the only thing that writes
    its parameters and state before the save has copied them. Given, the call returns without
    copying those: they are copied in the background beside the next forward and backward, and
    that `step()` waits until the copy is done (a step pre-hook); every other tensor (a buffer a
    forward changes) is copied before the call returns. Do not pass it if anything else writes the
    parameters in place before that step (an EMA copied into them, a manual `param.data` update,
    another optimizer sharing a parameter, a step replayed from a CUDA graph, a step pre-hook
    registered earlier), nor call this from inside `step()`. A state dict of copies
    (`StateDictOptions(cpu_offload=True)`) defers nothing: those copies are taken before the call."""
    _wait_for_async_save()
    coordination = Coordination(process_group, _save_name(where, step))  # made here: it may be a collective
    own, snapshot, deferred = None, _Snapshot(), None
    try:
        optimizers = optimizers_of(optimizer)
        snapshot, deferred = _snapshot(state_dict, metadata, step, staging=_STAGING, model=model,
                                       deferring=written_by(optimizers) if optimizers else None)
        if deferred is not None:
            _GATES.hold(optimizers, deferred)
    except Exception as error:
        own = error
    global _IN_FLIGHT
    try:
        with _LOCK:
            _IN_FLIGHT = _EXECUTOR.submit(_copy_and_save, coordination, where, step, snapshot, own, deferred)
    except BaseException:
        if deferred is not None:
            deferred.abandon()  # it will never run: the optimizer must not wait for it
        raise
    if own is not None:
        raise own  # the background exchange still tells the other ranks
    return _IN_FLIGHT


def _copy_and_save(coordination: Coordination, where: str, step: int, snapshot: _Snapshot,
                   own: BaseException | None, deferred: DeferredCopy | None) -> CheckpointRef:
    """On the saving thread: the deferred copy first (its failure is this rank's, told to the
    others at the first exchange), then the save."""
    if deferred is not None:
        if own is not None:
            deferred.abandon()  # the save fails at its first exchange: nothing to copy for
        else:
            try:
                deferred.run(_STAGING, snapshot.tensors)
            except Exception as error:  # noqa: BLE001 - reported through the save's exchanges
                own = error
    return _save(coordination, where, step, snapshot, own)


_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayshard-async-save")
_STAGING = HostStaging()  # reused by each async save: the previous one is done before the next copies
_LOCK = threading.Lock()
_IN_FLIGHT: Future | None = None


_GATES = StepGates()  # the optimizers' step pre-hooks, each waiting for its async save's copy


def _forget_the_parents_saves() -> None:
    """In a forked child: the parent's saving thread is not there (an executor inherited with it
    would take work and never run it), nor is its save in flight, whose copy the inherited
    optimizer hooks would wait for until their bound. The child starts with none of them."""
    global _EXECUTOR, _LOCK, _IN_FLIGHT
    _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayshard-async-save")
    _LOCK, _IN_FLIGHT = threading.Lock(), None
    _GATES.forget()


os.register_at_fork(after_in_child=_forget_the_parents_saves)


def _wait_for_async_save() -> None:
    """An async save in flight uses the same exchanges (and staging buffers): let it finish first.
    Its failure belongs to its own future, not to the call that waits."""
    with _LOCK:
        in_flight = _IN_FLIGHT
    if in_flight is not None:
        with contextlib.suppress(Exception):
            in_flight.result()
    _GATES.forget()  # its copy is over: the optimizers' hooks wait for nothing now


def _save_name(where, step) -> str:
    return f"save of {where}@{step}"


def _snapshot(state_dict: Mapping, metadata, step, staging: HostStaging | None, model: dict | None = None,
              deferring: set | None = None) -> tuple[_Snapshot, DeferredCopy | None]:
    """The state as the save writes it, and the copy left for later if any. With `staging`,
    tensors are host copies; with `deferring` too (the memory the optimizer writes, `written_by`),
    those tensors' copies are left to the `DeferredCopy` returned (their places in the snapshot
    are None until it runs)."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise ConfigError("step", step, f"must be a whole number from 0 to {MAX_STEP:,}",
                          "pass the optimizer steps completed, e.g. step=20")
    description = describe(model) if model is not None else None  # before any copy: a wrong one costs nothing
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise ConfigError("metadata", type(metadata).__name__, "must be a dict (kept as JSON)", "pass a dict or None")
        check_json_value("metadata", metadata)
    flat = flatten(state_dict)
    tensors = [piece.local for piece in flat.pieces]
    deferred = None
    if staging is not None:
        keys = [(piece.key, piece.held.offsets) for piece in flat.pieces]
        staging.keep_only(keys)
        later = [i for i, tensor in enumerate(tensors) if deferring and is_written_by(tensor, deferring)]
        deferred_indices = set(later)
        now = [i for i in range(len(tensors)) if i not in deferred_indices]
        copies: list = [None] * len(tensors)
        for index, copy in zip(now, staging.copy([keys[i] for i in now], [tensors[i] for i in now])):
            copies[index] = copy
        if later:
            deferred = DeferredCopy.of(later, [keys[i] for i in later], [tensors[i] for i in later], timeout_s())
        tensors = copies
    # JSON text now: a value the caller changes after an async save returns is not saved.
    snapshot = _Snapshot([piece.held for piece in flat.pieces], tensors, json.dumps(flat.values), json.dumps(metadata),
                         _mesh_of(flat), description)
    return snapshot, deferred


def _mesh_of(flat: FlatState) -> dict:
    """The mesh dims this rank's DTensors use, name -> size (informative, for `ckpt ls`)."""
    dims: dict[str, int] = {}
    for piece in flat.pieces:
        if isinstance(piece.tensor, DTensor):
            mesh = piece.tensor.device_mesh
            for index, size in enumerate(mesh.shape):
                name = (mesh.mesh_dim_names or ())[index] if mesh.mesh_dim_names else f"dim{index}"
                dims.setdefault(name, int(size))
    return dims


@dataclass(frozen=True)
class _Listing:
    """What a rank tells the first one as a save starts: the pieces it holds, and its values (JSON)."""

    held: list[HeldPiece]
    values: str


def merged_values(per_rank: list[dict]) -> dict:
    """Every rank's non-tensor values as one dict: a key any rank holds is kept (a pipeline
    stage's own entries, a rank's own loader state under its own key); a key several ranks hold
    keeps the lowest rank's value, as DCP keeps one copy of a key saved by several ranks."""
    merged: dict = {}
    for values in per_rank:
        for key, value in values.items():
            merged.setdefault(key, value)
    return merged


class _FirstRank:
    """What only the first rank keeps during a save: the run's writer lease and the attempt."""

    def __init__(self, location: RunLocation | None, step: int, model: ModelDescription | None = None):
        self.location, self.step, self.model = location, step, model
        self.values: dict = {}  # every rank's JSON values, merged (`merged_values`)
        self.pending: PendingCheckpoint | None = None
        self.error: BaseException | None = None  # its own failure while planning or committing, raised as is

    def failed(self, error: BaseException, coordination: Coordination) -> list[Failure]:
        self.error = error
        return [Failure.of(coordination.rank, error)]


def _save(coordination: Coordination, where: str, step: int, snapshot: _Snapshot, own: BaseException | None) -> CheckpointRef:
    """The save's four exchanges; the first rank plans and commits."""
    location = None
    if own is None:
        try:
            location = run_location(where)
            if location.step is not None:
                raise ConfigError("where", where, "names a run, not a checkpoint: the step is the `step` argument",
                                  f"pass where={where.rpartition('@')[0]!r}, step={location.step}")
        except Exception as error:
            own = error
    listed = coordination.gather("listing what each rank holds",
                                 _record(coordination, own, _Listing(snapshot.held, snapshot.values)))
    first = _FirstRank(location, step, snapshot.model) if coordination.is_root else None
    share = coordination.scatter("sending each rank its share of the writing",
                                 _plan_save(listed, first, coordination) if first else None)
    if isinstance(share, list):  # failures: the save stops before anything is written
        coordination.raise_failures(share, own or (first and first.error))
    written = None
    try:
        written = _write_share(share, snapshot)
    except Exception as error:
        own = error
    gathered = coordination.gather("collecting the chunks each rank wrote", _record(coordination, own, written))
    outcome = coordination.broadcast("publishing the commit",
                                     _commit(gathered, first, snapshot, coordination) if first else None)
    if isinstance(outcome, list):
        coordination.raise_failures(outcome, own or (first and first.error))
    return CheckpointRef(outcome, location.run, step)


def _record(coordination: Coordination, own: BaseException | None, answer):
    """What a rank sends: its answer, or its failure."""
    return Failure.of(coordination.rank, own) if own is not None else answer


# The runs this process writes, each with its writer lease (decision 97): taken by the first rank
# at its first save into the run, renewed in the background, released when the process exits, as
# the trainer holds its run's for as long as it trains. A second program saving into the run is
# refused in one line naming this one; a lease another writer took meanwhile fails the next save.
_LEASES: dict[tuple[str, str], writer_lease.WriterLease] = {}


def _writer_lease(store, run: str) -> writer_lease.WriterLease:
    key = (store.backend.url(f"{store.root}/{run}"), run)  # ./runs/a and /abs/runs/a are one run
    lease = _LEASES.get(key)
    if lease is not None:
        try:
            lease.check()
            return lease
        finally:
            if lease.lost is not None:
                _LEASES.pop(key, None)  # the save after this one tries to take it again
    lease = writer_lease.WriterLease(store, run, writer_lease.DEFAULT_TTL_S)
    # A training loop restarted by its launcher (torchrun, Ray Train) on another host meets its
    # killed predecessor's lease still looking alive: wait for it to lapse rather than refuse.
    lease.acquire(wait_s=writer_lease.DEFAULT_TTL_S + 10)
    lease.start_renewing()
    _LEASES[key] = lease
    return lease


os.register_at_fork(after_in_child=_LEASES.clear)  # a forked process holds no lease of its parent's


@atexit.register
def _release_leases() -> None:
    for lease in list(_LEASES.values()):
        with contextlib.suppress(Exception):
            lease.release()
    _LEASES.clear()


def _failures(records: list) -> list[Failure]:
    return [record for record in records if isinstance(record, Failure)]


def _plan_save(listed: list, first: _FirstRank, coordination: Coordination) -> list:
    """On the first rank: each rank's `_Assignment`, or for every rank the list of failures."""
    failures = _failures(listed)
    if failures:
        return [failures] * coordination.size
    first.values = merged_values([json.loads(listing.values) for listing in listed])
    listed = [listing.held for listing in listed]
    try:
        store, run = first.location.store, first.location.run
        _writer_lease(store, run)
        store.refuse_committed(run, first.step, "save under a new step, or into another run")
        if not any(listed):
            raise CheckpointError("the state dict holds no tensor on any rank; a checkpoint holds at least one. "
                                  "Fix: pass the model's and optimizer's state (get_state_dict)")
        writers = choose_writers(listed)
        if first.model is not None:  # every parameter against the model described, before anything is written
            shapes = first.model.shapes()
            check_shapes(first.model, {(held.name, held.kind): (held.global_shape, held.dtype) for pieces in listed
                                       for held in pieces if selected(held.name, held.kind, shapes)},
                         f"{run}@{first.step} (model=...)")
        first.pending = store.begin(run, first.step)
        return [_Assignment(first.pending.url, first.pending.file_for(rank), indices) for rank, indices in enumerate(writers)]
    except Exception as error:
        return [first.failed(error, coordination)] * coordination.size


def _write_share(share: _Assignment, snapshot: _Snapshot) -> ChunkTable:
    pieces = [Piece(held.name, held.kind, snapshot.tensors[index], held.global_shape, held.offsets)
              for index in share.indices for held in (snapshot.held[index],)]
    if not pieces:
        return ChunkTable.from_chunks([])
    fs, base = fsspec.core.url_to_fs(share.url)
    return ChunkTable.from_chunks(write_shard(fs, base, share.file, pieces))


def _commit(gathered: list, first: _FirstRank, snapshot: _Snapshot, coordination: Coordination):
    """On the first rank: the committed URL, or the list of failures (nothing committed; the
    attempt's files are a leftover `ckpt gc` removes)."""
    failures = _failures(gathered)
    if failures:
        return failures
    try:
        store, run = first.location.store, first.location.run
        latest = store.latest_step(run)
        parent = store.checkpoint_url(run, latest) if latest is not None and latest in store.committed_steps(run) else None
        metadata = {"run": run, "step": first.step, "writer": WRITER,
                    "layout": {"world_size": coordination.size, "mesh": snapshot.mesh},
                    "state": first.values, "metadata": json.loads(snapshot.user),
                    "parent": parent, "created_unix": time.time()}
        if first.model is not None:
            metadata[MODEL_DESCRIPTION] = first.model.record()
        _writer_lease(store, run)  # still this process's (renewed meanwhile): nobody else wrote the run since
        return first.pending.commit(ChunkTable.concat(gathered), metadata)
    except Exception as error:
        return first.failed(error, coordination)


# ---- load and plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Opened:
    """The checkpoint a load reads, as the first rank resolved it, with its manifest's bytes."""

    url: str
    run: str | None
    step: int | None  # as resolved; a checkpoint named by its directory has it in its manifest only
    manifest: bytes


@collector_paused()
def load(state_dict: Mapping, what: str, *, process_group=None) -> LoadedCheckpoint:
    """Fill `state_dict` in place from checkpoint `what` (a run URL or path, its LATEST; `RUN@STEP`;
    or a checkpoint directory), whatever layout wrote it and whatever layout the state dict has:
    each rank reads only the bytes of its own pieces. A collective, like `save`. Refuses, in one
    line naming the key, a state dict whose tensors or values the checkpoint does not hold alike
    (checkpoint entries the state dict does not ask for are left alone). Then
    `set_state_dict(model, optimizer, ...)` applies what was loaded, as after DCP's load."""
    _wait_for_async_save()
    coordination = Coordination(process_group, f"load of {what}")
    (flat, own), metadata = _flattened(state_dict), {}
    with contextlib.ExitStack() as held_by_first:  # the first rank's reader lease
        opened = _open(coordination, what, held_by_first)
        stats, stored, bands, replicas, verified = None, None, [], [], None
        # Decided from the URL alone, so alike on every rank: all of them take part in the agreement.
        banding = coordination.size > 1 and read_once_for(opened.url)
        try:
            if own is not None:
                raise own
            stored, metadata = _check(flat, opened, what)
            if banding:
                bands, replicas = _hand_overs(flat, stored, coordination, process_group)
        except Exception as error:
            own = error
        if banding:
            bands, replicas = _agree_on_hand_overs(coordination, own, bands, replicas)
        try:
            if own is None:
                stats = _read(stored, flat, bands, replicas)
                stats["partial_reads"] = stored.take_partial_reads()
        except Exception as error:
            own = error
        # Most loads read every chunk whole on one rank: nothing to combine, nothing to report.
        outcome = coordination.all_true("agreeing that every rank read its chunks whole",
                                        own is None and not stats["partial_reads"])
        if not outcome:
            gathered = coordination.gather("collecting what each rank read", _record(coordination, own, stats))
            verified = _verify_parts(gathered, opened) if coordination.is_root else None
            outcome = coordination.broadcast("verifying the chunks read in parts",
                                             [Failure.of(0, verified)] if isinstance(verified, BaseException) else verified)
    if isinstance(outcome, list):
        coordination.raise_failures(outcome, own or (verified if isinstance(verified, BaseException) else None))
    fill_values(flat, metadata.get("state") or {})
    return LoadedCheckpoint(opened.url, opened.run, _step_of(opened, metadata), metadata.get("metadata"))


def _hand_overs(flat: FlatState, stored: StoredCheckpoint, coordination: Coordination,
                process_group) -> tuple[list[MeshBand], list[ReplicaPiece]]:
    """This rank's pieces its groups read once on this store: the bands (column slices), then
    the replicas (pieces held alike) that are not banded."""
    bands = mesh_bands(flat, stored.index, min_segment_bytes_for(stored.fs))
    return bands, mesh_replicas(flat, stored.index, {band.key for band in bands}, coordination.group, process_group)


def _agree_on_hand_overs(coordination: Coordination, own: BaseException | None, bands: list[MeshBand],
                         replicas: list[ReplicaPiece]) -> tuple[list[MeshBand], list[ReplicaPiece]]:
    """The bands every member of their group listed alike (`agreed_bands`) and the replicas of
    the groups whose members all listed the same pieces (`agreed_groups`), their readers chosen;
    or, where a rank failed before reading, that failure on every rank: nobody starts a scatter
    or broadcast a peer never joins."""
    mine = (dist.get_rank(), [band.signature for band in bands], group_signatures(replicas))
    listed = coordination.gather("agreeing on the pieces read once per group", _record(coordination, own, mine))
    agreed = None
    if coordination.is_root:
        agreed = _failures(listed) or (agreed_bands([(rank, signatures) for rank, signatures, _ in listed]),
                                       agreed_groups([groups for _, _, groups in listed]))
    agreed = coordination.broadcast("sending the agreed pieces", agreed)
    if isinstance(agreed, list):
        coordination.raise_failures(agreed, own)
    banded, groups = agreed
    return ([band for band in bands if (band.ranks, band.key) in banded],
            with_readers([replica for replica in replicas if replica.group_id in groups]))


def _read(stored: StoredCheckpoint, flat: FlatState, bands: list[MeshBand], replicas: list[ReplicaPiece]) -> dict:
    """Read this rank's pieces; the banded ones and the replicas through its groups' hand-over
    (decision 172, 234). A member whose read fails still takes part in every scatter and
    broadcast; its error then fails every rank at the next exchange."""
    wanted = destinations(flat)
    if not bands and not replicas:
        return stored.read(wanted)
    pieces, readers, read_as, phases = hand_over_lists(bands, replicas)
    stats, received, failure = read_and_hand_over(stored, destinations_with_bands(wanted, bands, replicas), pieces,
                                                  readers, read_as, phases, dist.get_rank(), {},
                                                  reads_end_before_a_failure=True)
    if failure is not None:
        raise failure
    return {**stats, "bytes_received": received}


def _flattened(state_dict: Mapping) -> tuple[dict | None, Exception | None]:
    """The state dict flattened, or why it cannot be: a rank's own error is kept, not raised, so
    it reaches the other ranks at the next exchange instead of leaving them waiting."""
    try:
        return flatten(state_dict), None
    except Exception as error:
        return None, error


def _step_of(opened: _Opened, metadata: dict) -> int:
    step = metadata.get("step", opened.step)
    return int(step) if isinstance(step, int) else int(opened.step or 0)


@collector_paused()
def plan(state_dict: Mapping, what: str, *, process_group=None) -> LoadPlan:
    """The dry run of `load`: which bytes each rank would read (every rank gets every rank's plan).
    Reads the manifest only; checks the state dict against it as `load` does."""
    _wait_for_async_save()
    coordination = Coordination(process_group, f"plan of a load of {what}")
    (flat, own), metadata = _flattened(state_dict), {}
    with contextlib.ExitStack() as held_by_first:
        opened = _open(coordination, what, held_by_first)
        mine = None
        try:
            if own is not None:
                raise own
            stored, metadata = _check(flat, opened, what)
            wanted = destinations(flat)
            # As the load reads: banded pieces through their shares, replicas by their readers
            # (unagreed: a plan waits on no scatter, so members whose state dicts differ may be off).
            bands, replicas = (_hand_overs(flat, stored, coordination, process_group)
                               if coordination.size > 1 and read_once_for(opened.url) else ([], []))
            read = stored.plan(destinations_with_bands(wanted, bands, with_readers(replicas)))
            needed = sum(math.prod(target.sizes) * destination.tensor.element_size()
                         for target, destination in wanted.items())
            mine = RankPlan(coordination.rank, len(flat.pieces), needed, read.bytes_read, len(read.requests), read.files)
        except Exception as error:
            own = error
        gathered = coordination.gather("collecting each rank's plan", _record(coordination, own, mine))
        if coordination.is_root:
            gathered = _failures(gathered) or gathered
        ranks = coordination.broadcast("sending every rank's plan", gathered)
    failures = _failures(ranks)
    if failures or own is not None:
        coordination.raise_failures(failures, own)
    return LoadPlan(opened.url, _step_of(opened, metadata), ranks)


def _open(coordination: Coordination, what: str, held_by_first: contextlib.ExitStack) -> _Opened:
    """The first rank resolves `what`, takes a reader lease on it (so `ckpt gc` leaves it alone
    meanwhile) and sends it with its manifest to every rank; a failure there fails every rank."""
    opened, own = None, None
    if coordination.is_root:
        try:
            store, ref = resolve_checkpoint(what)
            held_by_first.enter_context(leases.reading(store, ref))
            # Its bytes once, decoded by each rank (which needs its chunks anyway): no second decode here.
            opened = _Opened(ref.url, ref.run, ref.step, manifest_bytes(ref.url))
        except Exception as error:
            own, opened = error, [Failure.of(coordination.rank, error)]
    opened = coordination.broadcast("finding the checkpoint", opened)
    if isinstance(opened, list):
        coordination.raise_failures(opened, own)
    return opened


def _check(flat: FlatState, opened: _Opened, what: str) -> tuple[StoredCheckpoint, dict]:
    chunks, metadata = read_manifest(opened.url, opened.manifest)
    stored_tensors = {key: (chunk.global_shape, chunk.dtype) for key, chunk in chunks.first_of_each_tensor().items()}
    values = metadata.get("state")
    check_state_dict_matches(flat.tensors, list(flat.values), stored_tensors, set(values) if isinstance(values, dict) else set(),
                             what)
    return StoredCheckpoint(opened.url, chunks, metadata, keys_checked=True), metadata


def _verify_parts(gathered: list, opened: _Opened):
    """On the first rank: True, the ranks' failures, or its own error (chunks whose parts, read
    by several ranks, do not combine to their checksum)."""
    failures = _failures(gathered)
    if failures:
        return failures
    try:
        reads = [read for stats in gathered for read in stats["partial_reads"]]
        verify_parts(reads, opened.url, lambda: StoredCheckpoint(opened.url, *read_manifest(opened.url, opened.manifest),
                                                                 keys_checked=True))
        return True
    except Exception as error:
        return error
