"""A group of RankActors: one placement-group bundle per rank, one process group over them."""
from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.rank import RankActor
from plans.config import TrainConfig
from plans.errors import ConfigError


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
        init_method = ray.get(self.actors[0].rendezvous_address.remote(), timeout=setup_timeout_s)
        self.setup_info = ray.get([actor.setup.remote(config, rank, init_method) for rank, actor in enumerate(self.actors)],
                                  timeout=setup_timeout_s)

    def call(self, method: str, *args, timeout: float | None = None) -> list:
        """Call `method` on every rank at once; results in rank order."""
        return ray.get([getattr(actor, method).remote(*args) for actor in self.actors], timeout=timeout)

    def call_each(self, method: str, per_rank_args: list[tuple], timeout: float | None = None) -> list:
        """Call `method` on every rank with that rank's own arguments; results in rank order."""
        return ray.get([getattr(actor, method).remote(*args) for actor, args in zip(self.actors, per_rank_args)],
                       timeout=timeout)

    def shutdown(self) -> None:
        try:
            ray.get([actor.shutdown.remote() for actor in self.actors], timeout=60)
        except Exception:  # a dead rank cannot shut down cleanly; killing it below is enough
            pass
        if self.owned:
            for actor in self.actors:
                ray.kill(actor)
            remove_placement_group(self.placement)
