"""Offline resharding: write a copy of a checkpoint laid out for another layout, once, for jobs
that load it many times (`rayshard ckpt reshard CKPT --to dp=..,tp=..,pp=.. --run NAME`).

Each target rank is played by a Ray actor (an actor may play several ranks when fewer are asked
for). A rank writes exactly the pieces it would write if it had trained in the target layout
(`plans/checkpoint/writers.py`: its regions, replicas written once and spread), and it gets each piece by
the same planned ranged reads a training load uses (`StoredCheckpoint.read`), a window of pieces
at a time, streaming them into its safetensors file. The driver then verifies the source chunks
that ranks read in parts (`storage/partial_reads.py`), checks the new chunks tile every tensor and
commits the manifest exactly as training does (create-only manifest, then LATEST).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import fsspec
import ray
import torch

from rayshard.actors.checkpoint.read_executor import WINDOW_BYTES, Destination

from rayshard.actors.checkpoint.shard_writer import LazyTensor, Piece, write_shard

from rayshard.storage.partial_reads import PartialRead
from rayshard.actors.checkpoint.stored import StoredCheckpoint, verify_parts
from rayshard.cluster.checkpoint.described_source import open_source
from rayshard.cluster.progress import advance, set_total
from rayshard.cluster.ray_connection import connect_ray
from rayshard.cluster.catalog import writer_lease
from rayshard.storage.options import apply_conf
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.errors import CheckpointError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.checkpoint.model_check import model_to_plan, require_model_record
from rayshard.plans.interop.model_description import MANIFEST_KEY, ModelDescription
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.plans.checkpoint.reshard import Target
from rayshard.plans.checkpoint.writers import PlannedPiece, predicted_writes
from rayshard.plans.checkpoint.regions import check_layout_fits, pipeline_partition


@dataclass
class ReshardResult:
    url: str
    run: str
    step: int
    bytes_read: int  # from storage, safetensors headers checked included
    bytes_written: int
    requests: int  # ranged reads made, over all ranks
    seconds: float
    ranks: int
    workers: int


@dataclass(frozen=True)
class RankWritten:
    """What playing one target rank wrote and read (returned through Ray as it is)."""
    chunks: tuple[Chunk, ...]
    # Parts of source chunks this rank read but cannot verify alone: the driver checks every
    # rank's together before it commits (an edit inside one must not become a valid new chunk).
    partial_reads: tuple[PartialRead, ...]
    bytes_read: int
    requests: int
    bytes_written: int


def target_partition(metadata: dict, layout: ParallelLayout, schedule: str | None = None,
                     stage_layout: list[int] | None = None):
    """The stage cut a job training on `layout` would use: the checkpoint's schedule unless one is given."""
    if layout.pp == 1:
        return None
    config = metadata.get("config") or {}
    pipeline = config.get("pipeline") or config  # a checkpoint written before the config had sections: flat keys
    if schedule is None:
        schedule = pipeline.get("schedule", "1f1b")  # pipeline_partition moves it to one that fits layout.vpp
    if stage_layout is None and pipeline.get("stage_layout") and metadata.get("layout") == layout.to_dict():
        stage_layout = list(pipeline["stage_layout"])  # the same layout: keep the checkpoint's own cut
    model = ModelConfig.from_dict(require_model_record(metadata, metadata.get("run", "to partition")))
    return pipeline_partition(model, layout, schedule, stage_layout)


def planned_writes(chunks: list[Chunk], metadata: dict, layout: ParallelLayout, schedule: str | None = None,
                   stage_layout: list[int] | None = None) -> list[list[PlannedPiece]]:
    model = model_to_plan(chunks, metadata, metadata.get("run", "being resharded"))
    check_layout_fits(model, layout)
    kinds = sorted({c.kind for c in chunks}, key=lambda k: ("param", "exp_avg", "exp_avg_sq").index(k)
                   if k in ("param", "exp_avg", "exp_avg_sq") else 9)
    dtypes = {c.dtype for c in chunks}
    if len(dtypes) != 1:
        raise CheckpointError(f"the checkpoint mixes dtypes {sorted(dtypes)}; offline resharding writes one dtype. "
                              "Fix: load it in training and save, which keeps each tensor's dtype")
    return predicted_writes(model, layout, target_partition(metadata, layout, schedule, stage_layout), kinds, dtypes.pop())


class WindowedReads:
    """A rank's pieces read through the load's path a window at a time: when the writer reaches a
    piece not yet read, it and the pieces after it, up to `window_bytes`, are planned and read
    together (one plan, requests coalesced across pieces, as a load does), and handed out one by
    one. At most a window of pieces is held, whatever the rank's size."""

    def __init__(self, source: StoredCheckpoint, pieces: list[PlannedPiece], window_bytes: int = WINDOW_BYTES):
        self.source, self.pieces, self.window_bytes = source, pieces, window_bytes
        self.ready: dict[int, torch.Tensor] = {}
        self.bytes_read = self.requests = 0

    def take(self, index: int) -> torch.Tensor:
        if index not in self.ready:
            self._read_window(index)
        return self.ready.pop(index)

    def _read_window(self, first: int) -> None:
        destinations, window = {}, 0
        for index in range(first, len(self.pieces)):
            piece = self.pieces[index]
            if destinations and window + piece.nbytes > self.window_bytes:
                break
            region = piece.region
            target = Target(region.name, piece.kind, region.offsets, region.sizes)
            if target in destinations:  # would leave one of the two tensors unread, yet written out
                raise CheckpointError(f"{region.name} ({piece.kind}) at {list(region.offsets)} is planned twice for one "
                                      "rank; this is a bug in the write plan, nothing was committed")
            tensor = torch.empty(region.sizes, dtype=getattr(torch, piece.dtype))
            destinations[target] = Destination(tensor, region.offsets)
            self.ready[index] = tensor
            window += piece.nbytes
        stats = self.source.read(destinations, self.window_bytes)
        self.bytes_read += stats["bytes_read"]
        self.requests += stats["requests"]


def write_rank(source: StoredCheckpoint, pieces: list[PlannedPiece], target_url: str, file: str) -> RankWritten:
    """Play one target rank: read its pieces through the load's read path, a window at a time,
    and stream them out."""
    reads = WindowedReads(source, pieces)
    lazy = [Piece(p.region.name, p.kind, LazyTensor(getattr(torch, p.dtype), p.region.sizes, lambda i=i: reads.take(i)),
                  p.region.global_shape, p.region.offsets) for i, p in enumerate(pieces)]
    chunks = []
    if lazy:
        fs, base = fsspec.core.url_to_fs(target_url)
        chunks = write_shard(fs, base, file, lazy)
    return RankWritten(tuple(chunks), tuple(source.take_partial_reads()), reads.bytes_read, reads.requests,
                       sum(c.byte_end - c.byte_start for c in chunks))


class ReshardWorker:
    """Plays target ranks, one call per rank; opens the source once, on its first rank. A Ray
    actor (one per worker) or, with local=True, a plain object in the driver."""

    def __init__(self, source_url: str, storage_conf: dict | None = None, description: ModelDescription | None = None):
        self.source_url, self.storage_conf, self.source = source_url, storage_conf, None
        self.description = description  # a rayshard.checkpoint checkpoint's model (described_source.py)

    def rank(self, pieces: list[PlannedPiece], target_url: str, file: str) -> RankWritten:
        if self.source is None:
            torch.set_num_threads(1)
            if self.storage_conf:  # reach the store with the driver's endpoint, retry and timeout policy
                apply_conf(self.storage_conf)
            self.source = open_source(self.source_url, self.description)
        return write_rank(self.source, pieces, target_url, file)


def _describe(layout: dict | None) -> str:
    try:
        return ParallelLayout.from_dict(layout or {}).describe()
    except Exception:  # a foreign or damaged layout entry is still worth printing
        return str(layout)


def _workers_that_fit(workers: int, cpus_per_worker: float, cluster_cpus: float, log, asked: bool = False) -> int:
    """As many of `workers` as the Ray cluster's CPUs can hold at once. Ray queues an actor that
    does not fit until CPUs free up, so the default of one worker per target rank would wait
    forever on a small cluster (four target ranks on a 2-CPU machine hung without a word); each
    worker plays several ranks. Workers asked for by number are kept (an autoscaling cluster grows
    to hold them), with a warning."""
    if cpus_per_worker <= 0:
        return workers
    if asked:
        if workers * cpus_per_worker > cluster_cpus:
            log(f"the Ray cluster has {cluster_cpus:g} CPUs now; {workers} worker(s) of {cpus_per_worker:g} CPU(s) "
                "start as it grows (on a cluster that does not, pass fewer --workers)")
        return workers
    fit = int(cluster_cpus // cpus_per_worker)
    if fit < 1:
        raise CheckpointError(f"the Ray cluster has {cluster_cpus:g} CPUs, fewer than one worker's "
                              f"--cpus-per-worker {cpus_per_worker:g}. Fix: lower --cpus-per-worker, or pass --local")
    if workers > fit:
        log(f"the Ray cluster has {cluster_cpus:g} CPUs: {fit} worker(s) of {cpus_per_worker:g} CPU(s) instead of "
            f"{workers}, each playing several target ranks (lower --cpus-per-worker for more workers)")
        return fit
    return workers


def reshard_checkpoint(source_url: str, layout: ParallelLayout, store, run: str, workers: int | None = None,
                       num_cpus: float = 1.0, local: bool = False, schedule: str | None = None,
                       stage_layout: list[int] | None = None, log=print, progress=None,
                       description: ModelDescription | None = None) -> ReshardResult:
    """Write and commit `run`@step: the checkpoint at source_url laid out for `layout`.
    local=True plays every rank in this process (same code, no Ray; for tests and small models).
    progress: a bar (cluster/progress.py) advanced by each rank's planned bytes when it finishes.
    It writes into `run` as a trainer does, so it holds the run's writer lease while it works:
    a trainer (or another reshard) on the same run is refused in one line, not raced.
    description: the model a `rayshard.checkpoint` checkpoint holds, and its naming; else the one
    it recorded at save (`described_source.py`). The copy has rayshard's names and records its model."""
    source = open_source(source_url, description)  # checked before the lease: a refusal leaves the run alone
    with writer_lease.holding(store, run):
        return _reshard_holding_the_lease(source_url, source, description, layout, store, run, workers, num_cpus, local,
                                          schedule, stage_layout, log, progress)


def _reshard_holding_the_lease(source_url, source, description, layout, store, run, workers, num_cpus, local, schedule,
                               stage_layout, log, progress) -> ReshardResult:
    started = time.perf_counter()
    chunks, metadata = source.chunks, source.metadata
    step = int(metadata["step"])
    plans = planned_writes(chunks, metadata, layout, schedule, stage_layout)
    copy = store.begin(run, step)
    jobs = [(pieces, copy.url, copy.file_for(rank)) for rank, pieces in enumerate(plans)]
    asked = workers is not None
    workers = max(1, min(workers or layout.world_size, layout.world_size))
    if not local:
        connect_ray()
        workers = _workers_that_fit(workers, num_cpus, ray.cluster_resources().get("CPU", 0.0), log, asked)
    planned = [sum(piece.nbytes for piece in pieces) for pieces in plans]
    log(f"resharding {source_url} ({_describe(metadata.get('layout'))}) to {layout.describe()} "
        f"({layout.world_size} ranks on {workers} {'local worker' if local else 'Ray actors'}{'s' if workers > 1 and local else ''})")
    set_total(progress, sum(planned))
    results: list[RankWritten | None] = [None] * len(jobs)
    if local:
        players = [ReshardWorker(source_url, None, description) for _ in range(workers)]
        for rank, job in enumerate(jobs):
            results[rank] = players[rank % workers].rank(*job)
            advance(progress, planned[rank])
    else:
        actor_class = ray.remote(num_cpus=num_cpus)(ReshardWorker)
        actors = [actor_class.remote(source_url, getattr(store, "storage_conf", None), description) for _ in range(workers)]
        try:
            # Rank r goes to actor r % workers; an actor plays its ranks in order. One future per
            # rank, so the driver sees (and the bar shows) each rank as it finishes.
            pending = {actors[rank % workers].rank.remote(*job): rank for rank, job in enumerate(jobs)}
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1)
                for future in done:
                    rank = pending.pop(future)
                    results[rank] = ray.get(future)
                    advance(progress, planned[rank])
        finally:
            for actor in actors:
                ray.kill(actor)
    verified_in_parts = verify_parts([read for result in results for read in result.partial_reads], source_url,
                                     lambda: getattr(source, "stored", source))  # the stored chunks, as named there
    new_chunks = [chunk for result in results for chunk in result.chunks]
    if {(c.name, c.kind) for c in new_chunks} != {(c.name, c.kind) for c in chunks}:
        raise CheckpointError("the resharded copy does not hold the same tensors as its source; nothing was committed")
    new_metadata = dict(metadata, run=run, layout=layout.to_dict(), parent=source_url,
                        resharded_from={"url": source_url, "layout": metadata.get("layout")},
                        created_unix=time.time())
    for stale in ("format_version", "writer", "model_names", MANIFEST_KEY):  # the copy: rayshard's names, its own model
        new_metadata.pop(stale, None)
    if layout.pp > 1:
        partition = target_partition(metadata, layout, schedule, stage_layout)
        new_metadata["stage_layers"] = [[r.start, r.stop] for r in partition.stage_layers]
    url = copy.commit(new_chunks, new_metadata)  # checks the new chunks tile every tensor
    result = ReshardResult(url, run, step, sum(r.bytes_read for r in results), sum(r.bytes_written for r in results),
                           sum(r.requests for r in results), time.perf_counter() - started, layout.world_size, workers)
    log(f"committed {url}: {result.bytes_read / 2**20:.1f} MiB read in {result.requests} requests, "
        f"{result.bytes_written / 2**20:.1f} MiB written "
        f"in {result.seconds:.1f}s" + (f"; {verified_in_parts} source chunks read in parts verified together"
                                        if verified_in_parts else ""))
    return result
