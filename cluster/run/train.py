"""The training driver: what `rayshard train` and `ray job submit -- python -m rayshard train` run.

Thin by design: validate the config, resolve what to resume from, start the rank group, then
one RPC per rank per step; ranks talk to each other over torch.distributed, not through here.
"""
from __future__ import annotations

import json
import time
from typing import Callable
from dataclasses import dataclass, field

import ray

from rayshard.cluster.run.pipeline_timings import PipelineTimings
from rayshard.storage.manifest_io import manifest_bytes, read_manifest
from rayshard.actors.checkpoint.stored import check_loaded_parts
from rayshard.cluster.catalog import leases
from rayshard.cluster.run.async_save import AsyncCheckpointer
from rayshard.cluster.run.rank_group import RankGroup, connect_ray
from rayshard.cluster.run.resume_check import verify_resumed_state
from rayshard.cluster.data.training_data import check_training_data, dataset_record, step_batch_hash, with_resolved_dataset
from rayshard.cluster.run.metrics_sinks import check_sinks, open_sinks
from rayshard.cluster.catalog.store import Store
from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.config import TrainConfig
from rayshard.plans.errors import ConfigError
from rayshard.plans.training.flops import throughput


@dataclass
class TrainResult:
    run: str
    start_step: int
    losses: dict[int, float] = field(default_factory=dict)  # completed step -> loss
    checkpoints: list[str] = field(default_factory=list)
    resumed_from: str | None = None
    step_seconds: list[float] = field(default_factory=list)
    stopped_early: bool = False
    # An MoE model: completed step -> MoE layer -> tokens each expert got over the global batch.
    expert_tokens: dict[int, dict[int, list[int]]] = field(default_factory=dict)


def _log(message: str) -> None:
    print(message, flush=True)


def train(config: TrainConfig, actors: list | None = None,
          stop_after_checkpoint: Callable[[int], bool] | None = None, async_save: bool = False) -> TrainResult:
    """Run (or resume) training.

    actors: live RankActors to borrow instead of starting new ones.
    async_save: a checkpoint blocks training only while ranks copy their state to CPU; uploads run
    in the background and commit at a later step (cluster/run/async_save.py).
    stop_after_checkpoint(step): asked after each committed checkpoint; True stops here (the
    elastic controller uses it to resize at a checkpoint, losing no work).
    """
    config = config.validate()
    store = Store(config.store)
    requested = config.resume
    if requested == "auto":  # resubmitting a run by name continues it; a new name starts fresh
        requested = "latest" if store.committed_steps(config.run) else None
    resume = store.resolve(requested, current_run=config.run) if requested else None
    start_step, parent = 0, None
    if resume is None and store.committed_steps(config.run):
        raise ConfigError("run", config.run,
                          f"already has checkpoints in {config.store} (steps {store.committed_steps(config.run)})",
                          "pass --resume latest (or auto) to continue it, or choose a new --run name")
    manifest = None
    if resume is not None:
        manifest = manifest_bytes(resume.url)  # read once here; the ranks get these bytes
        metadata = read_manifest(resume.url, manifest)[1]
        start_step, parent = int(metadata["step"]), resume.url
        _log(f"resuming from {resume.url} (step {start_step}, written by layout {metadata['layout']})")
        _warn_if_schedule_changed(metadata, config)
    check_training_data(config, metadata if resume is not None else None, parent)  # before any rank starts
    config = with_resolved_dataset(config)  # ranks read data.dataset, never probing the store before it is configured
    check_sinks(config)
    if start_step >= config.steps:
        _log(f"nothing to do: the checkpoint is at step {start_step} and --steps is {config.steps}")
        return TrainResult(config.run, start_step, resumed_from=parent)

    connect_ray()
    _log(f"run {config.run!r}: model {config.model_preset}, layout {config.layout.describe()} "
         f"({config.layout.world_size} ranks), steps {start_step}..{config.steps}, store {config.store}")
    if config.ac == "selective" and config.layout.pp > 1 and config.splits_backward:
        _log("note: --ac selective under a schedule that splits the backward into I and W recomputes each "
             "stage whole, once per microbatch, as --ac full does (docs/decisions.md 58)")
    started = time.perf_counter()
    group = RankGroup(config, actors)
    try:  # actors reach the store as the driver does
        group.call("configure_storage", store.storage_conf, timeout=config.start_timeout_s)
    except BaseException:
        group.shutdown()
        raise
    _log(f"{config.layout.world_size} rank actors ready on {group.setup_info[0].device} "
         f"in {time.perf_counter() - started:.1f}s")
    result = TrainResult(config.run, start_step, resumed_from=parent)
    sinks = open_sinks(config, store, start_step)
    _log("metrics: " + ", ".join(sink.where for sink in sinks))

    def committed(step: int, url: str) -> None:
        result.checkpoints.append(url)
        for sink in sinks:
            sink.flush()
        _log(f"checkpoint step {step} committed: {url}")

    fingerprint = group.setup_info[0].data_fingerprint
    saver = (AsyncCheckpointer(group, store, config.run, config.layout.world_size,
                               lambda step, parent: checkpoint_metadata(config, step, parent, fingerprint), committed)
             if async_save else None)
    timings = PipelineTimings(config)
    try:
        if resume is not None:
            with leases.reading(store, resume):  # `ckpt gc` keeps the checkpoint while ranks read it
                loaded = group.call("load", resume.url, ray.put(manifest))
                # A chunk the new layout cut across ranks was read in parts that no rank could check
                # alone: their checksums, combined, must give the chunk's before anything trains on it.
                in_parts = check_loaded_parts(resume.url, loaded, manifest)
            _log(f"loaded step {start_step}: {sum(r['bytes_read'] for r in loaded) / 2**20:.1f} MiB read over "
                 f"{len(loaded)} ranks" + (f"; {in_parts} chunks read in parts verified together" if in_parts else ""))
            if config.verify_resume:
                with leases.reading(store, resume):
                    check = verify_resumed_state(group, store, config.run, start_step, resume.url, str(config.layout))
                _log(f"resumed state verified: {check.tensors} tensors, digests equal to the checkpoint's "
                     f"({check.digest[:19]}...)")
        for step in range(start_step, config.steps):
            tick = time.perf_counter()
            per_rank = group.call_reporting_failures("train_step")
            metrics = per_rank[0]
            seconds = time.perf_counter() - tick
            timings.add(per_rank, seconds)
            done = metrics.step
            result.losses[done] = metrics.loss
            result.step_seconds.append(seconds)
            # As the ranks counted them: a data rank's tp and pp peers count the same tokens.
            tokens = (sum(rank.tokens for rank in per_rank) // (config.layout.tp * config.layout.pp)
                      or config.global_batch * config.seq_len)
            speed = throughput(config.model, config.seq_len, tokens, seconds, config.layout.world_size,
                               metrics.device_name, config.precision)
            peaks = [rank.peak_memory_bytes for rank in per_rank]
            record = {"step": done, "loss": metrics.loss, "grad_norm": metrics.grad_norm, "lr": metrics.lr,
                      "tokens": tokens, "tokens_per_s": speed.tokens_per_s, "tokens_per_s_per_rank": speed.tokens_per_s_per_rank,
                      "tflops_per_rank": speed.tflops_per_rank, "mfu": speed.mfu, "device": metrics.device_name,
                      "peak_memory_gib": max(peaks) / 2**30, "peak_memory_bytes_per_rank": peaks,
                      "step_s": seconds, "layout": str(config.layout), "precision": config.precision,
                      "time": time.time(), "batch_hash": step_batch_hash(per_rank, config.layout)}
            moe = ""
            if metrics.expert_tokens is not None:
                result.expert_tokens[done] = metrics.expert_tokens
                record.update(aux_loss=metrics.aux_loss, expert_tokens={str(k): v for k, v in metrics.expert_tokens.items()},
                              expert_load_imbalance=load_imbalance(metrics.expert_tokens),
                              all_to_all_bytes=metrics.all_to_all_bytes, all_to_all_peer_bytes=metrics.all_to_all_peer_bytes)
                moe = f" | aux {metrics.aux_loss:.4f} | expert load max/mean {record['expert_load_imbalance']:.2f}"
            for sink in sinks:
                sink.append(record)
            _log(f"step {done:>5}/{config.steps} | loss {metrics.loss:.4f} | grad_norm {metrics.grad_norm:.3f} "
                 f"| lr {metrics.lr:.2e} | {speed.describe()} | mem {record['peak_memory_gib']:.2f} GiB{moe}")
            if saver is not None:
                saver.poll()  # commits a finished background save; a failed one raises here
            if done == config.steps or (config.ckpt_every and done % config.ckpt_every == 0):
                if saver is not None:
                    parent = saver.start(done, parent)  # training waits only while ranks stage to CPU
                    if done == config.steps or stop_after_checkpoint is not None:
                        saver.wait()
                else:
                    parent = save_checkpoint(group, store, config, done, parent, group.setup_info[0].data_fingerprint)
                    committed(done, parent)
                if done < config.steps and stop_after_checkpoint is not None and stop_after_checkpoint(done):
                    result.stopped_early = True
                    _log(f"stopping after the checkpoint at step {done} as asked (resize)")
                    break
    finally:
        for sink in sinks:
            sink.close()
        timings.write(store)
        group.shutdown()
    return result


def load_imbalance(expert_tokens: dict[int, list[int]]) -> float:
    """The busiest expert's tokens over the mean, worst MoE layer: 1.0 is perfect balance, and
    under ep the busiest expert's rank sets the step's pace."""
    return max((max(counts) * len(counts) / max(1, sum(counts)) for counts in expert_tokens.values()), default=1.0)


def save_checkpoint(group: RankGroup, store: Store, config: TrainConfig, step: int, parent: str | None,
                    data_fingerprint: str) -> str:
    """Every rank writes its chunks under a fresh attempt prefix; the manifest commits them."""
    pending = store.begin(config.run, step)
    calls = [(pending.url, pending.file_for(rank)) for rank in range(config.layout.world_size)]
    # Each rank answers with its rows as columns (a ChunkTable); concatenating columns keeps the
    # driver free of a record per chunk (826k at 16k FSDP ranks: gather + check + encode ~1.7 s).
    chunks = ChunkTable.concat(group.call_each("save_shard", calls))
    return pending.commit(chunks, checkpoint_metadata(config, step, parent, data_fingerprint))


def checkpoint_metadata(config: TrainConfig, step: int, parent: str | None, data_fingerprint: str) -> dict:
    """Run metadata stored in the manifest next to the chunk table."""
    return {
        "run": config.run,
        "step": step,
        "layout": config.layout.to_dict(),
        "model_preset": config.model_preset,
        "model": config.model.to_dict(),
        "config": json.loads(json.dumps(config.to_dict(), default=str)),
        "data_position": {"seed": config.seed, "next_step": step, "corpus": data_fingerprint,
                          "source": config.data.source, "dataset": dataset_record(config)},
        # No rank-local RNG stream survives a step: every random draw is seeded by (seed, step).
        "rng": {"scheme": "seeded-per-step", "seed": config.seed},
        "lr_schedule": {**_lr_schedule(config), "step": step},
        "parent": parent,
        "created_unix": time.time(),
    }


def _lr_schedule(config: TrainConfig) -> dict:
    return {"kind": "warmup-cosine", **config.optimizer.__dict__, "decay_steps": config.optimizer.decay_steps or config.steps}


def _warn_if_schedule_changed(metadata: dict, config: TrainConfig) -> None:
    saved = {k: v for k, v in metadata.get("lr_schedule", {}).items() if k != "step"}
    now = _lr_schedule(config)
    changed = sorted(k for k in now if k in saved and saved[k] != now[k])
    if changed:
        _log("note: the learning-rate schedule differs from the checkpoint's in "
             + ", ".join(f"{k} ({saved[k]} -> {now[k]})" for k in changed)
             + "; the resumed run will not match an uninterrupted one. Pass the original values "
               "(e.g. --steps, or optimizer.decay_steps in the config) to continue the same schedule.")
