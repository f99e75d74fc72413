"""A group of RankActors: one placement-group bundle per rank, one process group over them."""
from __future__ import annotations

import time

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.rank import RankActor
from plans.config import TrainConfig
from plans.errors import ConfigError
from plans.pipeline.plan import build_pipeline_plan


def connect_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (set by `ray job submit`), else start a local one."""
    if not ray.is_initialized():
        ray.init(logging_level="WARNING", log_to_driver=True, include_dashboard=False,
                 configure_logging=True)


def bundle_for_rank(world_size: int) -> dict[str, float]:
    """A GPU per rank where the cluster has GPUs, else an equal fractional share of the CPUs."""
    resources = ray.cluster_resources()
    if resources.get("GPU", 0) >= 1:
        return {"GPU": 1, "CPU": min(1.0, resources.get("CPU", 1) / world_size)}
    share = min(1.0, resources.get("CPU", 1) / world_size)
    return {"CPU": max(0.01, round(share, 2))}


def start_actors(world: int, setup_timeout_s: float = 600.0):
    """One RankActor per rank in a fresh placement group. Returns (placement group, actors)."""
    bundle = bundle_for_rank(world)
    if "GPU" in bundle and ray.cluster_resources().get("GPU", 0) < world:
        raise ConfigError("layout", f"{world} ranks",
                          f"needs {world} GPUs but the Ray cluster has {ray.cluster_resources().get('GPU', 0):g}",
                          "lower the parallel degrees or add GPU nodes")
    placement = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
    ray.get(placement.ready(), timeout=setup_timeout_s)
    actors = [
        RankActor.options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=rank),
        ).remote()
        for rank in range(world)
    ]
    return placement, actors


# After a rank's process dies, its peers are stuck in collectives with it until their own
# timeout (minutes); waiting the full grace for their errors would only delay recovery.
DEAD_RANK_GRACE_S = 2.0


class StepFailed(RuntimeError):
    """One or more ranks failed a call; the message lists each rank's own error."""

    def __init__(self, method: str, failures: dict[int, str], silent: list[int], dead_ranks: list[int] = ()):
        self.failures, self.silent, self.dead_ranks = failures, list(silent), sorted(dead_ranks)
        lines = [f"{method} failed on {len(failures)} rank(s):"]
        lines += [f"  rank {rank}: {message}" for rank, message in sorted(failures.items())]
        if silent:
            lines.append(f"  no answer yet from rank(s) {silent}")
        super().__init__("\n".join(lines))


def _root_message(error: Exception) -> str:
    """The rank's own error message, without Ray's wrapping and traceback."""
    cause = getattr(error, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    return str(error).strip().splitlines()[-1]


class RankGroup:
    """The ranks of one training layout. Owns its actors, or borrows live ones (a pool in
    tests; survivors after a failure) and leaves them alive on shutdown."""

    def __init__(self, config: TrainConfig, actors: list | None = None, setup_timeout_s: float = 600.0):
        world = config.layout.world_size
        if actors is None:
            self.placement, self.actors, self.owned = *start_actors(world, setup_timeout_s), True
        else:
            if len(actors) < world:
                raise ConfigError("layout", config.layout.describe(), f"needs {world} ranks but {len(actors)} actors were given",
                                  "pass more actors or a smaller layout")
            self.placement, self.actors, self.owned = None, list(actors[:world]), False
        # The pipeline plan is built, lowered and checked here, once, and shipped with setup.
        self.plan = (build_pipeline_plan(config.model, config.layout, config.schedule, config.microbatches,
                                         config.stage_layout) if config.layout.pp > 1 else None)
        self.step_grace_s = (config.pipeline_timeout_s or config.collective_timeout_s) + 10.0
        self.broken = False  # a call failed: ranks may be stuck in collectives
        init_method = ray.get(self.actors[0].rendezvous_address.remote(), timeout=setup_timeout_s)
        self.setup_info = ray.get([actor.setup.remote(config, rank, init_method, self.plan)
                                   for rank, actor in enumerate(self.actors)], timeout=setup_timeout_s)

    def call(self, method: str, *args, timeout: float | None = None) -> list:
        """Call `method` on every rank at once; results in rank order."""
        return self._get([getattr(actor, method).remote(*args) for actor in self.actors], timeout)

    def call_reporting_failures(self, method: str, *args) -> list:
        """Like `call`, but when a rank fails, wait a grace period for the others' errors
        (a stalled peer makes its neighbours time out one after another) and raise one
        StepFailed naming every failed rank, instead of blocking on a rank that may never answer.
        A rank whose process died shortens the grace to DEAD_RANK_GRACE_S: its peers can only
        time out, and the group is lost anyway."""
        pending = {getattr(actor, method).remote(*args): rank for rank, actor in enumerate(self.actors)}
        results, failures, dead, deadline = {}, {}, [], None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                break
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except Exception as error:  # RayTaskError wraps the rank's exception
                failures[rank] = _root_message(error)
                grace = self.step_grace_s
                if isinstance(error, RayActorError):
                    dead.append(rank)
                    grace = DEAD_RANK_GRACE_S
                deadline = min(deadline or float("inf"), time.monotonic() + grace)
        if failures:
            self.broken = True
            raise StepFailed(method, failures, silent=sorted(pending.values()), dead_ranks=dead)
        return [results[rank] for rank in range(len(self.actors))]

    def call_each(self, method: str, per_rank_args: list[tuple], timeout: float | None = None) -> list:
        """Call `method` on every rank with that rank's own arguments; results in rank order."""
        return self._get([getattr(actor, method).remote(*args) for actor, args in zip(self.actors, per_rank_args)],
                         timeout)

    def _get(self, futures: list, timeout: float | None) -> list:
        try:
            return ray.get(futures, timeout=timeout)
        except Exception:
            self.broken = True
            raise

    def shutdown(self) -> None:
        # After a failed call, ranks may sit in a collective until their timeout: owned actors
        # are killed at once; borrowed ones get a short chance to leave their process group.
        if not (self.broken and self.owned):
            try:
                ray.get([actor.shutdown.remote() for actor in self.actors], timeout=5 if self.broken else 60)
            except Exception:  # a dead or stuck rank cannot shut down cleanly; killing it below is enough
                pass
        if self.owned:
            for actor in self.actors:
                ray.kill(actor)
            remove_placement_group(self.placement)
