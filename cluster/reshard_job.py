"""Offline resharding: write a copy of a checkpoint laid out for another layout, once, for jobs
that load it many times (`rayshard ckpt reshard CKPT --to dp=..,tp=..,pp=.. --run NAME`).

Each target rank is played by a Ray actor (an actor may play several ranks when fewer are asked
for). A rank writes exactly the pieces it would write if it had trained in the target layout
(`plans/save_plan.py`: its regions, replicas written once and spread), and it gets each piece by
the same planned ranged reads a training load uses (`StoredCheckpoint.read`), one piece at a
time, streaming it into its safetensors file. The driver then checks the chunks tile every
tensor and commits the manifest exactly as training does (create-only manifest, then LATEST).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import fsspec
import torch

from actors.checkpoint_io import LazyTensor, encode_manifest, write_shard
from actors.checkpointing import StoredCheckpoint, read_manifest
from cluster.progress import advance, set_total
from plans.chunks import Chunk
from plans.errors import CheckpointError
from plans.layout import ParallelLayout
from plans.model_spec import ModelConfig
from plans.reshard import check_chunks_disjoint_and_complete
from plans.save_plan import PlannedPiece, predicted_writes
from plans.target_regions import check_layout_fits, pipeline_partition


@dataclass
class ReshardResult:
    url: str
    run: str
    step: int
    bytes_read: int
    bytes_written: int
    seconds: float
    ranks: int
    workers: int


def target_partition(metadata: dict, layout: ParallelLayout, schedule: str | None = None,
                     stage_layout: list[int] | None = None):
    """The stage cut a job training on `layout` would use: the checkpoint's schedule unless one is given."""
    if layout.pp == 1:
        return None
    config = metadata.get("config") or {}
    if schedule is None:
        schedule = config.get("schedule", "1f1b")
        if layout.vpp > 1 and str(schedule).replace("-", "").lower() in ("1f1b", "gpipe", "zbh1"):
            schedule = "interleaved1f1b"
    if stage_layout is None and config.get("stage_layout") and metadata.get("layout") == layout.to_dict():
        stage_layout = list(config["stage_layout"])  # the same layout: keep the checkpoint's own cut
    model = ModelConfig.from_dict(metadata["model"])
    return pipeline_partition(model, layout, schedule, stage_layout)


def planned_writes(chunks: list[Chunk], metadata: dict, layout: ParallelLayout, schedule: str | None = None,
                   stage_layout: list[int] | None = None) -> list[list[PlannedPiece]]:
    model = ModelConfig.from_dict(metadata["model"])
    check_layout_fits(model, layout)
    kinds = sorted({c.kind for c in chunks}, key=lambda k: ("param", "exp_avg", "exp_avg_sq").index(k)
                   if k in ("param", "exp_avg", "exp_avg_sq") else 9)
    dtypes = {c.dtype for c in chunks}
    if len(dtypes) != 1:
        raise CheckpointError(f"the checkpoint mixes dtypes {sorted(dtypes)}; offline resharding writes one dtype. "
                              "Fix: load it in training and save, which keeps each tensor's dtype")
    return predicted_writes(model, layout, target_partition(metadata, layout, schedule, stage_layout), kinds, dtypes.pop())


def write_rank(source: StoredCheckpoint, pieces: list[PlannedPiece], target_url: str, file: str) -> dict:
    """Play one target rank: read each of its pieces through the load's read path and stream it out."""
    stats = {"bytes_read": 0, "bytes_written": 0}

    def loader(piece: PlannedPiece):
        def load():
            region = piece.region
            tensor = source.read_region(region.name, piece.kind, region.offsets, region.sizes)
            stats["bytes_read"] += tensor.numel() * tensor.element_size()
            return tensor
        return load

    lazy = [(p.region.name, p.kind, LazyTensor(getattr(torch, p.dtype), p.region.sizes, loader(p)),
             p.region.global_shape, p.region.offsets) for p in pieces]
    if not lazy:
        return {"rows": [], **stats}
    fs, base = fsspec.core.url_to_fs(target_url)
    chunks = write_shard(fs, base, file, lazy)
    stats["bytes_written"] = sum(c.byte_end - c.byte_start for c in chunks)
    return {"rows": [c.to_row() for c in chunks], **stats}


class ReshardWorker:
    """Plays target ranks, one call per rank; opens the source once, on its first rank. A Ray
    actor (one per worker) or, with local=True, a plain object in the driver."""

    def __init__(self, source_url: str, storage_conf: dict | None = None):
        self.source_url, self.storage_conf, self.source = source_url, storage_conf, None

    def rank(self, pieces: list[PlannedPiece], target_url: str, file: str) -> dict:
        if self.source is None:
            torch.set_num_threads(1)
            if self.storage_conf:  # reach the store with the driver's endpoint, retry and timeout policy
                from cluster.object_store import apply_conf

                apply_conf(self.storage_conf)
            self.source = StoredCheckpoint(self.source_url)
        return write_rank(self.source, pieces, target_url, file)


def _describe(layout: dict | None) -> str:
    try:
        return ParallelLayout.from_dict(layout or {}).describe()
    except Exception:  # a foreign or damaged layout entry is still worth printing
        return str(layout)


def reshard_checkpoint(source_url: str, layout: ParallelLayout, store, run: str, workers: int | None = None,
                       num_cpus: float = 1.0, local: bool = False, schedule: str | None = None,
                       stage_layout: list[int] | None = None, log=print, progress=None) -> ReshardResult:
    """Write and commit `run`@step: the checkpoint at source_url laid out for `layout`.
    local=True plays every rank in this process (same code, no Ray; for tests and small models).
    progress: a bar (cluster/progress.py) advanced by each rank's planned bytes when it finishes."""
    started = time.perf_counter()
    chunks, metadata = read_manifest(source_url)
    step = int(metadata["step"])
    plans = planned_writes(chunks, metadata, layout, schedule, stage_layout)
    target_url = store.checkpoint_url(run, step)
    attempt = store.new_attempt()
    jobs = [(pieces, target_url, f"{attempt}/rank-{rank:05d}.safetensors") for rank, pieces in enumerate(plans)]
    workers = max(1, min(workers or layout.world_size, layout.world_size))
    planned = [sum(piece.nbytes for piece in pieces) for pieces in plans]
    log(f"resharding {source_url} ({_describe(metadata.get('layout'))}) to {layout.describe()} "
        f"({layout.world_size} ranks on {workers} {'local worker' if local else 'Ray actors'}{'s' if workers > 1 and local else ''})")
    set_total(progress, sum(planned))
    results: list[dict] = [{}] * len(jobs)
    if local:
        players = [ReshardWorker(source_url) for _ in range(workers)]
        for rank, job in enumerate(jobs):
            results[rank] = players[rank % workers].rank(*job)
            advance(progress, planned[rank])
    else:
        import ray

        from cluster.rank_group import connect_ray

        connect_ray()
        actor_class = ray.remote(num_cpus=num_cpus)(ReshardWorker)
        actors = [actor_class.remote(source_url, getattr(store, "storage_conf", None)) for _ in range(workers)]
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
    new_chunks = [Chunk.from_row(row) for result in results for row in result["rows"]]
    check_chunks_disjoint_and_complete(new_chunks)
    if {(c.name, c.kind) for c in new_chunks} != {(c.name, c.kind) for c in chunks}:
        raise CheckpointError("the resharded copy does not hold the same tensors as its source; nothing was committed")
    new_metadata = dict(metadata, run=run, layout=layout.to_dict(), parent=source_url,
                        resharded_from={"url": source_url, "layout": metadata.get("layout")},
                        created_unix=time.time())
    new_metadata.pop("format_version", None)
    if layout.pp > 1:
        partition = target_partition(metadata, layout, schedule, stage_layout)
        new_metadata["stage_layers"] = [[r.start, r.stop] for r in partition.stage_layers]
    url = store.commit(run, step, encode_manifest(new_chunks, new_metadata))
    result = ReshardResult(url, run, step, sum(r["bytes_read"] for r in results), sum(r["bytes_written"] for r in results),
                           time.perf_counter() - started, layout.world_size, workers)
    log(f"committed {url}: {result.bytes_read / 2**20:.1f} MiB read, {result.bytes_written / 2**20:.1f} MiB written "
        f"in {result.seconds:.1f}s")
    return result
