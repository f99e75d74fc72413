"""Elastic training: the controller driving real Ray rank groups.

Each attempt asks Ray what the cluster has now, lets the layout chooser pick a layout for it
(user-pinned dimensions kept), and runs `train` with `resume=auto`: the first attempt starts
the run (or continues it, if the run name already has checkpoints — a resubmitted job or a new
driver after the old one died), later attempts resume from LATEST and reshard onto the new
layout. A dead rank, a lost node or an unrecoverable step error ends the attempt; the failure
policy decides whether to go again. More ranks appearing triggers a resize at the next checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from rayshard.cluster.run.controller import Controller, Outcome, RunResult
from rayshard.cluster.ray_connection import connect_ray
from rayshard.cluster.run.rank_group import StepFailed
from rayshard.cluster.run.rank_pool import RankPool
from rayshard.cluster.run.train import train
from rayshard.plans.config import TrainConfig
from rayshard.plans.elastic import FailurePolicy, ScalingPolicy
from rayshard.plans.errors import ConfigError, ResourcesUnavailable
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.layout.resources import equal_cpu_share, rank_bundle, ranks_offered
from rayshard.plans.layout.chooser import Workload, choose_layout, pinned_ranks
from rayshard.plans.training.converters import run_roles

# What a rank losing its process or node, an unrecoverable step, or ranks the cluster did not
# grant in time (ResourcesUnavailable: the policy decides whether to wait again) look like.
RANK_FAILURES = (RayActorError, RayTaskError, GetTimeoutError, StepFailed, ResourcesUnavailable)


@dataclass
class TrainingWorkerGroup:
    config: TrainConfig
    # Ranks the pinned dimensions need: with no --cpus-per-rank, each rank gets an equal share of
    # the CPUs over this many ranks (at most one CPU), as a non-elastic job does over its world.
    wanted_ranks: int = 1
    actors: list | None = None  # live RankActors each attempt borrows, as train() takes them (else the pool's)
    # Without given actors: the ranks kept across attempts, so a recovery restarts only the lost ones.
    pool: RankPool | None = field(default=None, repr=False)
    furthest_step: int = 0  # the furthest step any attempt has trained (when the pool's spares start)

    def rank_bundle(self, world: int | None = None) -> dict[str, float]:
        """CPU ranks: a share fixed over wanted_ranks, so the rank count follows from the CPUs.
        GPU ranks: the count follows from the GPUs; the CPUs are shared over the world started."""
        resources = self.config.resources
        cluster, cpus, gpus = ray.cluster_resources(), resources.cpus_per_rank, resources.gpus_per_rank
        bundle = rank_bundle(cluster, self.wanted_ranks, cpus, gpus)
        return rank_bundle(cluster, world, cpus, gpus) if "GPU" in bundle and world else bundle

    def _pool(self) -> RankPool:
        if self.pool is None:
            self.pool = RankPool(self.config.resources.start_timeout_s)
        return self.pool

    def _spares_once_regained(self):
        """A step callback that starts the pool's warm spares once this attempt trains a step past the
        furthest any attempt reached: after a first start or a resize at its first step, after a
        recovery once it has redone the lost steps. A spare's start (importing torch, a few
        CPU-seconds) slowed the recovery's first steps on the cores the ranks share (decision 215);
        the spares are for the next failure, and regaining the lost steps comes first."""
        reached_before, started = self.furthest_step, False

        def after_step(done: int) -> None:
            nonlocal started
            self.furthest_step = max(self.furthest_step, done)
            if not started and done > reached_before:
                started = True
                self.pool.start_spares()
        return after_step

    def release(self) -> None:
        """Kill the pool's ranks and free their resources (given actors stay the caller's)."""
        if self.pool is not None:
            self.pool.release()

    def available_ranks(self) -> int:
        cluster, bundle = ray.cluster_resources(), self.rank_bundle()
        if "GPU" in bundle:
            return ranks_offered(cluster, {"GPU": bundle["GPU"]})[0]
        return ranks_offered(cluster, bundle)[0]

    def capacity(self) -> str:
        """What the cluster offers, and why: '2 ranks (2 CPUs / 1 CPU per rank)'."""
        offered, why = ranks_offered(ray.cluster_resources(), self.rank_bundle())
        return f"{offered} ranks ({why})"

    def run(self, layout: ParallelLayout, should_resize) -> RunResult:
        bundle = self.rank_bundle(layout.world_size)
        config = replace(self.config, layout=layout, checkpoint=replace(self.config.checkpoint, resume="auto"),
                         resources=replace(self.config.resources, cpus_per_rank=bundle.get("CPU", 0),
                                           gpus_per_rank=bundle.get("GPU", 0)))
        try:
            actors = self.actors if self.actors is not None else self._pool().actors_for(layout.world_size, bundle)
            result = train(config, actors, stop_after_checkpoint=lambda step: should_resize(),
                           after_step=self._spares_once_regained() if self.actors is None else None)
        except RANK_FAILURES as error:
            if self.pool is not None and isinstance(error, StepFailed):
                self.pool.condemn(error.dead_ranks)
                self.pool.expect_busy(error.silent)
            return RunResult(Outcome.FAILED, error, f"{type(error).__name__}: {_first_line(error)}")
        self.release()  # done or resizing: a new world starts its own ranks
        if result.stopped_early:
            return RunResult(Outcome.RESIZE, detail=f"more ranks available; resizing after step {max(result.losses)}")
        return RunResult(Outcome.FINISHED, detail=f"step {config.steps} reached")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def layout_chooser_for(config: TrainConfig, pinned: dict[str, int], memory_per_rank_bytes: float, ranks_per_node: int,
                       capacity=lambda: ""):
    roles = run_roles(config)
    work = Workload(config.global_batch, config.seq_len, config.pipeline.microbatches, config.numerics.precision,
                    config.numerics.ac, roles.count(trained=True) if roles.has_frozen else None,
                    snapshots=bool(config.checkpoint.snapshot_every), host_budget=_ranks_on_host(config))
    needed = pinned_ranks(pinned)

    def choose(ranks: int):
        if ranks < needed:  # say what is missing: ranks, not memory
            offered = capacity() or f"{ranks} ranks"
            raise ConfigError("layout", ", ".join(f"{k}={v}" for k, v in pinned.items()),
                              f"the pinned dimensions need {needed} ranks but the cluster offers {offered}",
                              f"pass --cpus-per-rank {_share_for(needed):g} or less (or leave it unset), add nodes, "
                              "or pin fewer dimensions")
        return choose_layout(ranks, config.model.spec, work, memory_per_rank_bytes, ranks_per_node=ranks_per_node,
                             pinned=pinned, vpp=config.layout.vpp, accepts=lambda layout: runs_on(config, layout))

    return choose


def _ranks_on_host(config: TrainConfig) -> bool:
    """Whether ranks run on CPUs, their memory budget being host memory (snapshots count in it)."""
    if config.resources.gpus_per_rank:
        return False
    return not (ray.is_initialized() and ray.cluster_resources().get("GPU"))


def runs_on(config: TrainConfig, layout: ParallelLayout) -> bool:
    """Whether the run's settings validate on `layout`: a recovery must never pick a layout that
    the run's own validation would then refuse (sequence parallelism on tp 1, a pipeline order from
    a file on another pp, a schedule on a vpp it does not run)."""
    try:
        replace(config, layout=layout, resources=replace(config.resources, world_size=None)).validate()
    except ConfigError:
        return False
    return True


def _share_for(ranks: int) -> float:
    return equal_cpu_share(ray.cluster_resources().get("CPU", 0), ranks) if ray.is_initialized() else 1.0 / ranks


def train_elastic(config: TrainConfig, pinned: dict[str, int], scaling: ScalingPolicy, failure: FailurePolicy,
                  memory_per_rank_bytes: float = 64 * 2**30, ranks_per_node: int = 8, cpus_per_rank: float | None = None):
    """cpus_per_rank: overrides config.resources.cpus_per_rank (None: the config's; unset there, an
    equal share of the CPUs over max(min_ranks, the ranks the pinned dimensions need), at most one)."""
    connect_ray()
    if cpus_per_rank is not None:
        config = replace(config, resources=replace(config.resources, cpus_per_rank=cpus_per_rank))
    group = TrainingWorkerGroup(config, max(scaling.min_ranks, pinned_ranks(pinned)))
    controller = Controller(group, layout_chooser_for(config, pinned, memory_per_rank_bytes, ranks_per_node,
                                                      group.capacity),
                            failure_policy=failure, scaling_policy=scaling)
    try:
        return controller, controller.run()
    finally:
        group.release()
