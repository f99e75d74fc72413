"""A group of RankActors: one placement-group bundle per rank, one process group over them."""
from __future__ import annotations

import re
import sys
import time

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayshard.actors.rank import RankActor
from rayshard.plans.config import TrainConfig
from rayshard.plans.errors import ConfigError, RayshardError, ResourcesUnavailable, StepFailed, from_rank
from rayshard.plans.layout.resources import GRAIN, not_ready_failure, placement_failure, rank_bundle
from rayshard.plans.pipeline.plan import build_pipeline_plan

__all__ = ["RankGroup", "StepFailed", "start_actors", "bundle_for_rank", "wait_alive"]

DEFAULT_START_TIMEOUT_S = 60.0


def bundle_for_rank(world_size: int, cpus_per_rank: float | None = None,
                    gpus_per_rank: float | None = None) -> dict[str, float]:
    """A GPU per rank where the cluster has GPUs, else an equal share of the CPUs that fits
    (plans/layout/resources.py); explicit per-rank amounts win."""
    return rank_bundle(ray.cluster_resources(), world_size, cpus_per_rank, gpus_per_rank)


def start_actors(world: int, start_timeout_s: float = DEFAULT_START_TIMEOUT_S, cpus_per_rank: float | None = None,
                 gpus_per_rank: float | None = None, log=print):
    """One RankActor per rank in a fresh placement group, waiting at most start_timeout_s for the
    group and again for the actors to come alive. Returns (placement group, actors); raises
    ResourcesUnavailable naming what was asked for and what the cluster has."""
    bundle = bundle_for_rank(world, cpus_per_rank, gpus_per_rank)
    total = ray.cluster_resources()
    if any(round(total.get(kind, 0) * GRAIN) < world * round(amount * GRAIN) for kind, amount in bundle.items()):
        # Never wait silently: an autoscaler may still add nodes, so wait the bound, but say so.
        log(f"waiting up to {start_timeout_s:g} s for {world} ranks x {bundle}: more than the cluster's "
            f"{ {kind: total.get(kind, 0) for kind in bundle} } in total")
    placement = placement_group([dict(bundle) for _ in range(world)], strategy="PACK")
    ready, _ = ray.wait([placement.ready()], timeout=start_timeout_s)
    if not ready:
        free = ray.available_resources()
        remove_placement_group(placement)
        raise ResourcesUnavailable(placement_failure(world, bundle, free, ray.cluster_resources(), start_timeout_s))
    actors = [
        RankActor.options(
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement, placement_group_bundle_index=rank),
        ).remote()
        for rank in range(world)
    ]
    try:
        wait_alive(actors, start_timeout_s)
    except BaseException:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(placement)
        raise
    return placement, actors


def wait_alive(actors: list, timeout_s: float) -> None:
    pending = {actor.__ray_ready__.remote(): rank for rank, actor in enumerate(actors)}
    ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=timeout_s)
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError as error:
            raise ResourcesUnavailable(f"rank actor {pending[ref]} died while starting: {_root_message(error)}. "
                                       "Fix: check the actor's log (`ray logs`) and the worker's environment") from None
    not_ready = sorted(rank for ref, rank in pending.items() if ref not in ready)
    if not_ready:
        raise ResourcesUnavailable(not_ready_failure(not_ready, len(actors), timeout_s))


# After a rank's process dies, its peers are stuck in collectives with it until their own
# timeout (minutes); waiting the full grace for their errors would only delay recovery. Peers
# whose sockets saw the death fail within milliseconds; one still silent after this is replaced
# alongside the dead rank by an elastic run (cluster/run/rank_pool.py), which costs no more than
# the dead rank's own restart, so waiting longer for it buys nothing (issue 41: was 2 s).
DEAD_RANK_GRACE_S = 0.5
# After a rank's own error, its peers fail within a second or two once it has left the group
# (actors/rank.py); a peer still silent after this is stuck where leaving did not reach it (a
# pending transfer keeps a gloo group alive), and waiting out its timeout (up to an hour for a
# pipeline) would hide the error that matters: the step fails now, naming it as silent.
FAILED_PEER_GRACE_S = 15.0
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def user_error_kinds() -> tuple[type[BaseException], ...]:
    """Errors of the user's making (input, checkpoint, storage): one line each, no traceback."""
    botocore = sys.modules.get("botocore.exceptions")
    kinds = (RayshardError, OSError)
    return kinds if botocore is None else kinds + (botocore.BotoCoreError, botocore.ClientError)


def _cause(error: BaseException) -> BaseException | None:
    """The exception the rank itself raised, when it reached the driver (it pickles)."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, BaseException) and not isinstance(error, RayActorError) else None


def _raised_at(cause: BaseException | None) -> float:
    """When the rank raised it (actors/rank.py stamps it before leaving its group); unknown: last."""
    stamp = getattr(cause, "rayshard_raised_unix", None)
    return stamp if isinstance(stamp, float) else float("inf")


def _remote_traceback(error: BaseException) -> str:
    """The rank's traceback: as the rank wrote it down before dropping its frames (actors/rank.py),
    else as Ray formats it (first line: the actor call), without colour codes."""
    written = getattr(_cause(error), "rayshard_rank_traceback", None)
    if isinstance(written, str) and written:
        return written.strip()
    text = ANSI.sub("", str(error)).strip()
    return text if text.startswith("Traceback") else f"Traceback (most recent call last), on the rank:\n{text}"


def _root_message(error: BaseException) -> str:
    """The rank's own error message, without Ray's wrapping and traceback."""
    cause = _cause(error)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    return ANSI.sub("", str(error)).strip().splitlines()[-1]


class RankGroup:
    """The ranks of one training layout. Owns its actors, or borrows live ones (a pool in
    tests; survivors after a failure) and leaves them alive on shutdown.

    Every wait on the ranks is bounded (docs/decisions.md lists them): start-up by the config's
    start_timeout_s, set-up by that plus the collective timeout, and any other call by
    call_timeout_s. A rank's own error of the user's making (RayshardError, storage) is raised as
    itself, marked with its rank (plans/errors.from_rank); anything else becomes StepFailed.

    initialize: the ranks draw the initial weights; False when the caller loads a checkpoint
    holding every parameter right after (`train.start_ranks`)."""

    def __init__(self, config: TrainConfig, actors: list | None = None, initialize: bool = True):
        world = config.layout.world_size
        if actors is None:
            resources = config.resources
            self.placement, self.actors = start_actors(world, resources.start_timeout_s, resources.cpus_per_rank,
                                                       resources.gpus_per_rank)
            self.owned = True
        else:
            if len(actors) < world:
                raise ConfigError("layout", config.layout.describe(), f"needs {world} ranks but {len(actors)} actors were given",
                                  "pass more actors or a smaller layout")
            self.placement, self.actors, self.owned = None, list(actors[:world]), False
        # The pipeline plan is built, lowered and checked here, once, and shipped with setup.
        pipeline = config.pipeline
        self.plan = (build_pipeline_plan(config.model.spec, config.layout, pipeline.schedule, pipeline.microbatches,
                                         pipeline.stage_layout, pipeline.schedule_csv) if config.layout.pp > 1 else None)
        self.step_grace_s = (config.pipeline.timeout_s or config.resources.collective_timeout_s) + 10.0
        self.call_timeout_s = config.resources.call_timeout_s
        self.broken = False  # a call failed: ranks may be stuck in collectives
        try:
            init_method = self.call_each("rendezvous_address", [()], timeout=config.resources.start_timeout_s,
                                         actors=self.actors[:1])[0]
            # Set-up joins the process group, which waits up to the collective timeout for every peer.
            self.setup_info = self.call_each("setup", [(config, rank, init_method, self.plan, initialize)
                                                       for rank in range(world)],
                                             timeout=config.resources.start_timeout_s + config.resources.collective_timeout_s)
        except BaseException:
            self.shutdown()
            raise

    def call(self, method: str, *args, timeout: float | None = None) -> list:
        """Call `method` on every rank at once; results in rank order. The first rank error of
        the user's making is raised as itself (with its rank), at once."""
        return self.call_each(method, [args] * len(self.actors), timeout)

    def call_each(self, method: str, per_rank_args: list[tuple], timeout: float | None = None,
                  actors: list | None = None) -> list:
        """Call `method` on every rank with that rank's own arguments; results in rank order."""
        actors = self.actors if actors is None else actors
        futures = {getattr(actor, method).remote(*args): rank for rank, (actor, args) in enumerate(zip(actors, per_rank_args))}
        return self._gather(method, futures, timeout, first_user_error=True)

    def call_reporting_failures(self, method: str, *args, timeout: float | None = None) -> list:
        """Like `call`, but when a rank fails, wait a short grace (FAILED_PEER_GRACE_S) for the
        others' errors (a rank that fails leaves the group, so its peers fail at once) and raise one
        StepFailed naming every failed rank, instead of blocking on a rank that may never answer.
        A rank whose process died shortens the grace to DEAD_RANK_GRACE_S: its peers can only
        time out, and the group is lost anyway."""
        futures = {getattr(actor, method).remote(*args): rank for rank, actor in enumerate(self.actors)}
        return self._gather(method, futures, timeout, first_user_error=False)

    def _gather(self, method: str, pending: dict, timeout: float | None, first_user_error: bool) -> list:
        timeout = self.call_timeout_s if timeout is None else timeout
        results, failures, causes, tracebacks, dead = {}, {}, {}, {}, []
        started = time.monotonic()
        deadline = started + timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except Exception as error:  # RayTaskError wraps the rank's exception
                self.broken = True
                cause = _cause(error)
                if first_user_error and isinstance(cause, user_error_kinds()):
                    raise from_rank(cause, rank, _remote_traceback(error)) from None
                failures[rank], tracebacks[rank] = _root_message(error), _remote_traceback(error)
                if cause is not None:
                    causes[rank] = cause
                grace = min(self.step_grace_s, FAILED_PEER_GRACE_S)
                if isinstance(error, RayActorError):
                    dead.append(rank)
                    grace = DEAD_RANK_GRACE_S
                # A plain call stops at the first failure; call_reporting_failures waits a grace
                # for the other ranks' own errors.
                deadline = min(deadline, time.monotonic() + (0.0 if first_user_error else grace))
        if failures or pending:
            self.broken = True
            # The rank that failed first first: a rank whose process died (no stamp; its peers'
            # errors follow from it), then by the time each rank raised, then by number.
            first = lambda r: (-1.0 if r in dead else _raised_at(causes.get(r)), r)  # noqa: E731
            failures = {rank: failures[rank] for rank in sorted(failures, key=first)}
            raise StepFailed(method, failures, silent=sorted(pending.values()), dead_ranks=dead, causes=causes,
                             tracebacks=tracebacks, waited_s=round(time.monotonic() - started, 1))
        return [results[rank] for rank in sorted(results)]

    def shutdown(self) -> None:
        # After a failed call, ranks may sit in a collective until their timeout: owned actors
        # are killed at once; borrowed ones get a short chance to leave their process group.
        if not self.broken:
            try:
                ray.get([actor.shutdown.remote() for actor in self.actors], timeout=60)
            except Exception:  # a dead or stuck rank cannot shut down cleanly; killing it below is enough
                pass
        elif not self.owned:
            # Not waited for: a rank that failed has left its group already (actors/rank.py), a
            # stuck one would only answer after its collective timeout, and the next setup on a
            # reused actor runs after this call and leaves any group first anyway.
            for actor in self.actors:
                actor.shutdown.remote()
        if self.owned:
            for actor in self.actors:
                ray.kill(actor)
            remove_placement_group(self.placement)
