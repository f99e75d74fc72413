"""The training driver: what `rayshard train` and `ray job submit -- python -m rayshard train` run.

Thin by design: validate the config, resolve what to resume from, start the rank group, then
one RPC per rank per step; ranks talk to each other over torch.distributed, not through here.
"""
from __future__ import annotations

import json
import time
from typing import Callable
from dataclasses import asdict, dataclass, field, replace

import ray

from rayshard.cluster.run.pipeline_timings import PipelineTimings
from rayshard.storage.manifest_io import manifest_bytes, read_manifest
from rayshard.actors.checkpoint.stored import check_loaded_parts
from rayshard.cluster.catalog import commit_window, leases, writer_lease
from rayshard.cluster.run.async_save import AsyncCheckpointer
from rayshard.actors.training.dataset_source import prepared_dataset_url
from rayshard.cluster.run.reference_logprobs import check_precomputed
from rayshard.cluster.run.dpo_reference import FROZEN_COPY, DpoReference, resolve_reference
from rayshard.cluster.run.lora_base import LoraBase, resolve_base, with_resumed_lora
from rayshard.cluster.ray_connection import connect_ray
from rayshard.cluster.run.rank_group import RankGroup
from rayshard.cluster.run.resume_check import verify_resumed_state
from rayshard.cluster.run.snapshots import Snapshots, snapshot_failure
from rayshard.cluster.data.training_data import check_training_data, dataset_record, step_batch_hash, with_resolved_dataset
from rayshard.cluster.run.metrics_sinks import check_sinks, open_sinks
from rayshard.cluster.catalog.store import CheckpointRef, Store
from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.config import TrainConfig
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.plans.training.converters import run_roles
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


@dataclass
class StartPoint:
    """What a run starts from, resolved before any rank starts: the validated config (its
    dataset resolved), the store, the step to train from and, resuming, the checkpoint and its
    manifest's bytes (read once here; the ranks get these bytes)."""
    config: TrainConfig
    store: Store
    step: int = 0
    resume: CheckpointRef | None = None
    manifest: bytes | None = None
    parent: str | None = None  # the checkpoint the run's next save descends from
    lease: writer_lease.WriterLease | None = None  # the run's writer lease, held while it trains
    snapshots: Snapshots | None = None  # --snapshot-every: the run's snapshots in the nodes' memory
    from_memory: bool = False  # the resume reads a snapshot, not the store
    lora_base: LoraBase | None = None  # a LoRA run's frozen weights (cluster/run/lora_base.py)
    dpo_reference: DpoReference | None = None  # --objective dpo's reference (cluster/run/dpo_reference.py)


def train(config: TrainConfig, actors: list | None = None,
          stop_after_checkpoint: Callable[[int], bool] | None = None,
          after_step: Callable[[int], None] | None = None) -> TrainResult:
    """Run (or resume) training: resolve where it starts, start the ranks, run the steps.

    actors: live RankActors to borrow instead of starting new ones.
    stop_after_checkpoint(step): asked after each committed checkpoint; True stops here (the
    elastic controller uses it to resize at a checkpoint, losing no work).
    after_step(step): called as each step is done and reported (the elastic controller starts its
    warm spares once an attempt has regained the furthest step, off the recovery's path).
    """
    config = config.validate()
    store = Store(config.store)
    # One trainer per run: a second one is refused here, before any rank starts (writer_lease.py).
    with writer_lease.holding(store, config.run, config.checkpoint.writer_lease_s) as lease:
        snapshots = None
        if config.checkpoint.snapshot_every:
            connect_ray(config.resources.start_timeout_s)  # the keepers are actors
            snapshots = Snapshots(config.store, config.run, config.checkpoint.snapshot_every, durable=store)
        point = resolve_start(config, store, snapshots)
        point.lease = lease
        if snapshots is not None:
            snapshots.forget_after(point.step)  # the steps after it are redone, and snapshotted again
            if point.from_memory:
                snapshots.resumed_from(point.step)
        if point.step >= point.config.steps:
            _log(f"nothing to do: the checkpoint is at step {point.step} and --steps is {point.config.steps}")
            return TrainResult(point.config.run, point.step, resumed_from=point.parent)
        group = start_ranks(point, actors)
        return run_steps(group, point, stop_after_checkpoint, after_step)


def resolve_start(config: TrainConfig, store: Store, snapshots: Snapshots | None = None) -> StartPoint:
    """Find the checkpoint to resume from (if any) and check the data and metric sinks against
    it: everything that can refuse the (validated) run before a rank starts. The caller holds the
    run's writer lease, so a commit of this run that LATEST does not name is a dead trainer's.
    With snapshots, a continuing run resumes from the newest whole snapshot in memory when it is
    newer than the checkpoint LATEST names."""
    requested = config.checkpoint.resume
    if requested == "auto":  # resubmitting a run by name continues it; a new name starts fresh
        requested = "latest" if store.committed_steps(config.run) else None
    if requested in ("latest", config.run):  # continuing from LATEST: first adopt what it missed
        commit_window.adopt_unnamed_commits(store, config.run)
    resume = store.resolve(requested, current_run=config.run) if requested else None
    if resume is None and store.committed_steps(config.run):
        raise ConfigError("run", config.run,
                          f"already has checkpoints in {config.store} (steps {store.committed_steps(config.run)})",
                          "pass --resume latest (or auto) to continue it, or choose a new --run name")
    point, metadata = StartPoint(config, store, resume=resume, snapshots=snapshots), None
    if snapshots is not None and config.checkpoint.resume in ("auto", "latest", config.run):
        choice = snapshots.choose(resume.step if resume is not None else None)
        point.resume, point.from_memory = (choice.ref, True) if choice.ref is not None else (resume, False)
        if choice.ref is not None or "no snapshot" not in choice.why:
            _log(f"recovery: {choice.why}; resuming from "
                 + ("memory" if point.from_memory else (resume.url if resume is not None else "the start")))
        resume = point.resume
    if resume is not None:
        point.manifest = manifest_bytes(resume.url)
        metadata = read_manifest(resume.url, point.manifest)[1]
        # A snapshot's own URL is not durable: the next checkpoint descends from the one it did.
        point.step, point.parent = int(metadata["step"]), (metadata.get("parent") if point.from_memory else resume.url)
        _log(f"resuming from {resume.url} (step {point.step}, written by layout {metadata['layout']})")
        _warn_if_schedule_changed(metadata, config)
        if resume.run == config.run and metadata.get("run") not in (None, config.run):
            _log(f"note: {resume.url} sits in run {config.run!r} but was written by run {metadata['run']!r} (copied "
                 "in?); resuming from it as asked. To branch from another run, resume it by its own name "
                 f"(--resume {metadata['run']}@{point.step}) under a new --run")
        if resume.run == config.run and not point.from_memory:
            commit_window.refuse_rewrites(store, config.run, point.step)
    check_training_data(config, metadata, point.parent)  # before any rank starts
    config = with_resumed_lora(config, metadata).validate()
    point.lora_base = resolve_base(config, store, metadata)
    if point.lora_base is not None:
        _log(f"LoRA rank {config.lora.rank} on {config.lora.targets}; base: {point.lora_base.describe()}")
    point.dpo_reference = resolve_reference(config, store, metadata, resume.url if resume is not None else None,
                                            point.lora_base)
    if point.dpo_reference is not None:
        if config.dpo.precomputed:  # the ranks read exactly this file (decision 202)
            config = replace(config, dpo=replace(config.dpo, logprobs_file=check_precomputed(
                prepared_dataset_url(config), point.dpo_reference)))
        _log(f"DPO ({config.dpo.loss}, beta {config.dpo.beta:g}); reference: {point.dpo_reference.describe()}"
             + (f", log-probabilities precomputed in the dataset's {config.dpo.logprobs_file}" if config.dpo.precomputed else ""))
    point.config = with_resolved_dataset(config)  # ranks read data.dataset, never probing the store before it is configured
    check_sinks(point.config)
    return point


def filled_by_resume(point: StartPoint) -> bool:
    """Whether the resumed checkpoint fills every parameter, so the ranks need not draw initial
    weights first (a small-preset rank spent 0.17 s of its 0.20 s set-up drawing them, on every
    recovery's path; docs/decisions.md 219). The load proves it: a parameter the checkpoint lacks
    fails it, and its chunks must cover every element. A run with frozen parameters (LoRA, a
    frozen base) keeps drawing: those come from a base checkpoint, or are the drawn weights."""
    return point.resume is not None and not run_roles(point.config).has_frozen


def start_ranks(point: StartPoint, actors: list | None) -> RankGroup:
    """One actor per rank (or the borrowed ones), their process group formed and their storage
    configured as the driver's."""
    config = point.config
    connect_ray(config.resources.start_timeout_s)
    _log(f"run {config.run!r}: model {config.model.preset}, layout {config.layout.describe()} "
         f"({config.layout.world_size} ranks), steps {point.step}..{config.steps}, store {config.store}")
    if config.numerics.ac == "selective" and config.layout.pp > 1 and config.pipeline.splits_backward:
        _log("note: --ac selective under a schedule that splits the backward into I and W recomputes each "
             "stage whole, once per microbatch, as --ac full does (docs/decisions.md 58)")
    started = time.perf_counter()
    group = RankGroup(config, actors, initialize=not filled_by_resume(point))
    try:  # actors reach the store as the driver does
        group.call("configure_storage", point.store.storage_conf, timeout=config.resources.start_timeout_s)
    except BaseException:
        group.shutdown()
        raise
    _log(f"{config.layout.world_size} rank actors ready on {group.setup_info[0].device} "
         f"in {time.perf_counter() - started:.1f}s")
    return group


def run_steps(group: RankGroup, point: StartPoint, stop_after_checkpoint: Callable[[int], bool] | None,
              after_step: Callable[[int], None] | None = None) -> TrainResult:
    """Load the resumed state, then one call per rank per step, with a checkpoint at every
    checkpoint.every steps and at the end; the ranks are shut down whatever happens."""
    config, store = point.config, point.store
    result = TrainResult(config.run, point.step, resumed_from=point.parent)
    sinks = open_sinks(config, store, point.step)
    _log("metrics: " + ", ".join(sink.where for sink in sinks))
    saves = Saves(group, point, result, sinks)
    if point.snapshots is not None and saves.background is None:  # one background save per rank at a time
        point.snapshots.in_background(group, config.layout.world_size,
                                      lambda step, parent: checkpoint_metadata(config, step, parent, saves.fingerprint,
                                                                               saves.lora_base, saves.dpo_reference))
    timings = PipelineTimings(config)
    try:
        if point.lora_base is not None and point.lora_base.url is not None:
            load_base(group, point)
        if point.resume is not None:
            load_resumed(group, point)
        reference = point.dpo_reference
        if reference is not None and reference.kind == FROZEN_COPY and reference.url and not config.dpo.precomputed:
            load_reference(group, point)
        for _ in range(point.step, config.steps):
            if point.lease is not None:
                point.lease.check()  # a trainer that lost the run to another stops before its next step
            tick = time.perf_counter()
            per_rank = group.call_reporting_failures("train_step")
            seconds = time.perf_counter() - tick
            timings.add(per_rank, seconds)
            if point.snapshots is not None:  # before the step's record, so it names the newest snapshot
                point.snapshots.poll(per_rank[0].step)
            done = report_step(config, per_rank, seconds, result, sinks,
                               point.snapshots.describe() if point.snapshots is not None else None)
            if after_step is not None:
                after_step(done)
            saves.poll()
            durable = done == config.steps or (config.checkpoint.every and done % config.checkpoint.every == 0)
            if point.snapshots is not None:
                if point.snapshots.due(done) and not (durable and saves.background is None):
                    take_snapshot(group, point.snapshots, config, done, saves)
            if durable:
                saves.save(done, wait=done == config.steps or stop_after_checkpoint is not None)
                if done < config.steps and stop_after_checkpoint is not None and stop_after_checkpoint(done):
                    result.stopped_early = True
                    _log(f"stopping after the checkpoint at step {done} as asked (resize)")
                    break
    finally:
        lost_run = point.lease is not None and point.lease.lost is not None
        if point.snapshots is not None:
            point.snapshots.settle(lost_run)
        if saves.background is not None:
            saves.background.settle()  # a commit in flight ends before the lease is released
        finish(group, store, sinks, timings, lost_run=lost_run)
    return result


def finish(group: RankGroup, store: Store, sinks: list, timings: PipelineTimings, lost_run: bool = False) -> None:
    """Close the metric sinks, write the pipeline's measured costs, and let the ranks go (whatever
    the sinks do). A trainer that lost the run to another appends nothing more to its files."""
    try:
        for sink in sinks:
            if lost_run and hasattr(sink, "discard"):
                sink.discard()
            sink.close()
        timings.write(store)
    finally:
        group.shutdown()


def load_base(group: RankGroup, point: StartPoint) -> None:
    """Every rank reads its part of a LoRA run's frozen base weights (any layout wrote them)."""
    _load_frozen(group, point, point.lora_base.url, "load_base", "the LoRA base")


def load_reference(group: RankGroup, point: StartPoint) -> None:
    """Every rank reads its part of a DPO run's frozen reference (any layout wrote it)."""
    _load_frozen(group, point, point.dpo_reference.url, "load_reference", "the DPO reference")


def _load_frozen(group: RankGroup, point: StartPoint, url: str, rank_method: str, what: str) -> None:
    """Weights no optimizer updates, read by every rank under a reader lease (a gc must not take
    the checkpoint mid-read) and checked whole."""
    ref = point.store.resolve(url)
    with leases.reading(point.store, ref):
        loaded = group.call(rank_method, ref.url)
        check_loaded_parts(ref.url, loaded)
    _log(f"loaded {what}: {sum(r['bytes_read'] for r in loaded) / 2**20:.1f} MiB read over {len(loaded)} ranks")


def load_resumed(group: RankGroup, point: StartPoint) -> None:
    """Every rank reads its part of the checkpoint (and, with checkpoint.verify_resume, the loaded
    state is proved equal to it) while a lease keeps `ckpt gc` from removing it."""
    config, store, resume = point.config, point.store, point.resume
    home = point.snapshots.store if point.from_memory else store  # the lease goes beside what it keeps
    started = time.perf_counter()
    with leases.reading(home, resume):
        loaded = group.call("load", resume.url, ray.put(point.manifest))
        # A chunk the new layout cut across ranks was read in parts that no rank could check
        # alone: their checksums, combined, must give the chunk's before anything trains on it.
        in_parts = check_loaded_parts(resume.url, loaded, point.manifest)
    _log(f"loaded step {point.step}: {sum(r['bytes_read'] for r in loaded) / 2**20:.1f} MiB read "
         f"{'from the snapshot in memory' if point.from_memory else 'from storage'} over {len(loaded)} ranks in "
         f"{time.perf_counter() - started:.2f} s" + (f"; {in_parts} chunks read in parts verified together" if in_parts else ""))
    if config.checkpoint.verify_resume:
        with leases.reading(home, resume):
            check = verify_resumed_state(group, store, config.run, point.step, resume.url, str(config.layout))
        _log(f"resumed state verified: {check.tensors} tensors, digests equal to the checkpoint's "
             f"({check.digest[:19]}...)")


def take_snapshot(group: RankGroup, snapshots: Snapshots, config: TrainConfig, step: int, saves: "Saves") -> None:
    """Every rank saves its share to the keepers (the same save as a checkpoint's, to memory). A
    snapshot that fails (a keeper lost) is skipped with one line: the last checkpoint still covers
    a failure, and the failure that lost the keeper ends this attempt by itself if it took a rank."""
    if snapshots.background is not None:
        try:
            snapshots.start(step, saves.parent)
        except CheckpointError as error:  # the previous snapshot's failure, reported as it is waited for
            _log(f"snapshot not taken: {str(error).splitlines()[0][:300]}; training goes on")
        return
    started = time.perf_counter()
    try:
        save_checkpoint(group, snapshots.store, config, step, saves.parent, saves.fingerprint, saves.lora_base,
                        rank_method="save_snapshot_shard", dpo_reference=saves.dpo_reference)
    except Exception as error:  # noqa: BLE001 - only a snapshot's own failures are swallowed
        why = snapshot_failure(error)
        if why is None:
            raise
        _log(f"snapshot of step {step} not taken: {why}; training goes on")
        return
    snapshots.taken(step, time.perf_counter() - started)


def report_step(config: TrainConfig, per_rank: list, seconds: float, result: TrainResult, sinks: list,
                snapshot: dict | None = None) -> int:
    """Record one finished step (result, sinks, console); returns the step's number."""
    metrics = per_rank[0]
    done = metrics.step
    result.losses[done] = metrics.loss
    result.step_seconds.append(seconds)
    # As the ranks counted them: a data rank's tp and pp peers count the same tokens.
    peers = config.layout.tp * config.layout.pp
    tokens = sum(rank.tokens for rank in per_rank) // peers or config.global_batch * config.seq_len
    # SFT and DPO rows are padded: tokens/s counts the examples' tokens, MFU what was computed (decision 203).
    computed = sum(rank.computed_tokens for rank in per_rank) // peers or tokens
    roles = run_roles(config)
    speed = throughput(config.model.spec, config.seq_len, tokens, seconds, config.layout.world_size,
                       metrics.device_name, config.numerics.precision,
                       roles.count(trained=True) if roles.has_frozen else None, computed_tokens=computed)
    peaks = [rank.peak_memory_bytes for rank in per_rank]
    record = {"step": done, "loss": metrics.loss, "grad_norm": metrics.grad_norm, "lr": metrics.lr,
              "tokens": tokens, "tokens_per_s": speed.tokens_per_s, "tokens_per_s_per_rank": speed.tokens_per_s_per_rank,
              "tflops_per_rank": speed.tflops_per_rank, "mfu": speed.mfu, "device": metrics.device_name,
              "peak_memory_gib": max(peaks) / 2**30, "peak_memory_bytes_per_rank": peaks,
              "step_s": seconds, "layout": str(config.layout), "precision": config.numerics.precision,
              "time": time.time(), "batch_hash": step_batch_hash(per_rank, config.layout), **(snapshot or {})}
    extra = ""
    if metrics.rewards is not None:  # --objective dpo
        record.update(metrics.rewards)
        extra = (f" | rewards chosen {metrics.rewards['rewards_chosen']:.4f} rejected {metrics.rewards['rewards_rejected']:.4f}"
               f" margin {metrics.rewards['rewards_margin']:.4f} accuracy {metrics.rewards['rewards_accuracy']:.2f}")
    if metrics.expert_tokens is not None:
        result.expert_tokens[done] = metrics.expert_tokens
        record.update(aux_loss=metrics.aux_loss, expert_tokens={str(k): v for k, v in metrics.expert_tokens.items()},
                      expert_load_imbalance=load_imbalance(metrics.expert_tokens),
                      all_to_all_bytes=metrics.all_to_all_bytes, all_to_all_peer_bytes=metrics.all_to_all_peer_bytes)
        extra += f" | aux {metrics.aux_loss:.4f} | expert load max/mean {record['expert_load_imbalance']:.2f}"
    for sink in sinks:
        sink.append(record)
    _log(f"step {done:>5}/{config.steps} | loss {metrics.loss:.4f} | grad_norm {metrics.grad_norm:.3f} "
         f"| lr {metrics.lr:.2e} | {speed.describe()} | mem {record['peak_memory_gib']:.2f} GiB{extra}")
    return done


class Saves:
    """A run's checkpoints: each commits before training goes on, or, with checkpoint.async_save,
    blocks training only while ranks copy their state to CPU and commits at a later step
    (cluster/run/async_save.py)."""

    def __init__(self, group: RankGroup, point: StartPoint, result: TrainResult, sinks: list):
        self.group, self.store, self.config = group, point.store, point.config
        self.parent, self.result, self.sinks, self.lease = point.parent, result, sinks, point.lease
        self.lora_base, self.dpo_reference = point.lora_base, point.dpo_reference
        self.fingerprint = group.setup_info[0].data_fingerprint
        self.background = (AsyncCheckpointer(group, self.store, self.config.run, self.config.layout.world_size,
                                             lambda step, parent: checkpoint_metadata(self.config, step, parent,
                                                                                      self.fingerprint, self.lora_base,
                                                                                      self.dpo_reference),
                                             self.committed)
                           if self.config.checkpoint.async_save else None)

    def committed(self, step: int, url: str) -> None:
        self.result.checkpoints.append(url)
        _log(f"checkpoint step {step} committed: {url}")

    def poll(self) -> None:
        if self.background is not None:
            self.background.poll()  # commits a finished background save; a failed one raises here

    def save(self, step: int, wait: bool) -> None:
        """Save `step`; in the background unless `wait` (the last step, or a resize may follow)."""
        if self.lease is not None:
            self.lease.check()
        for sink in self.sinks:  # before the commit: a crash after the manifest must not lose these steps
            sink.flush()
        if self.background is not None:
            self.parent = self.background.start(step, self.parent)  # training waits only while ranks stage to CPU
            if wait:
                self.background.wait()
        else:
            self.parent = save_checkpoint(self.group, self.store, self.config, step, self.parent, self.fingerprint,
                                          self.lora_base, dpo_reference=self.dpo_reference)
            self.committed(step, self.parent)


def load_imbalance(expert_tokens: dict[int, list[int]]) -> float:
    """The busiest expert's tokens over the mean, worst MoE layer: 1.0 is perfect balance, and
    under ep the busiest expert's rank sets the step's pace."""
    return max((max(counts) * len(counts) / max(1, sum(counts)) for counts in expert_tokens.values()), default=1.0)


def save_checkpoint(group: RankGroup, store: Store, config: TrainConfig, step: int, parent: str | None,
                    data_fingerprint: str, lora_base: LoraBase | None = None, rank_method: str = "save_shard",
                    dpo_reference: DpoReference | None = None) -> str:
    """Every rank writes its chunks under a fresh attempt prefix; the manifest commits them."""
    pending = store.begin(config.run, step)
    calls = [(pending.url, pending.file_for(rank)) for rank in range(config.layout.world_size)]
    # Each rank answers with its rows as columns (a ChunkTable); concatenating columns keeps the
    # driver free of a record per chunk (826k at 16k FSDP ranks: gather + check + encode ~1.7 s).
    chunks = ChunkTable.concat(group.call_each(rank_method, calls))
    return pending.commit(chunks, checkpoint_metadata(config, step, parent, data_fingerprint, lora_base, dpo_reference))


def checkpoint_metadata(config: TrainConfig, step: int, parent: str | None, data_fingerprint: str,
                        lora_base: LoraBase | None = None, dpo_reference: DpoReference | None = None) -> dict:
    """Run metadata stored in the manifest next to the chunk table; a LoRA run's names its adapters'
    settings and its base (cluster/run/lora_base.py), a DPO run's its settings and reference
    (cluster/run/dpo_reference.py)."""
    lora = {"lora": asdict(config.lora), "lora_base": lora_base.to_dict()} if lora_base is not None else {}
    dpo = {"dpo": asdict(config.dpo), "dpo_reference": dpo_reference.to_dict()} if dpo_reference is not None else {}
    return {**lora, **dpo,
        "run": config.run,
        "step": step,
        "layout": config.layout.to_dict(),
        "model_preset": config.model.preset,
        "model": config.model.spec.to_dict(),
        "config": json.loads(json.dumps(config.to_dict(), default=str)),
        # What the loss was: a resume may change it (sft after lm pretraining), the record says which.
        "objective": config.objective,
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
