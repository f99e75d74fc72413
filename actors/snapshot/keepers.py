"""Starting the snapshot keepers: one per alive node, pinned there, owned by the driver.

A keeper is not a rank: it lives from the job's start to its end, across the attempts of the
elastic controller, so the snapshot of the step a rank died in is still in memory when the
replacement ranks start. It takes no CPU share (it only holds bytes and answers reads).
"""
from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rayshard.actors.snapshot.keeper import SnapshotKeeper, keeper_name

KEEPER_CONCURRENCY = 8  # reads of one recovery run in parallel; writes serialise on the keeper's lock
# The handles this process started. Ray ends an actor, named or not, once no handle to it is
# left, so the driver keeps these for its lifetime: the keepers outlive each attempt's ranks and
# go with the driver (not detached: a finished job leaves no memory held).
_STARTED: dict[str, object] = {}


def start_keepers(timeout_s: float = 120.0) -> dict[str, object]:
    """A keeper on every alive node that has none yet (or whose keeper died: it starts empty);
    node id -> handle of every keeper."""
    _forget_dead(timeout_s)
    keepers = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id, name = node["NodeID"], keeper_name(node["NodeID"])
        if node_id in _STARTED:
            keepers[node_id] = _STARTED[node_id]
            continue
        try:
            keepers[node_id] = ray.get_actor(name)  # another process of this job started it, and keeps it
        except ValueError:
            # The creating handle is the one that keeps it alive: a handle from get_actor does not.
            keepers[node_id] = _STARTED[node_id] = ray.remote(SnapshotKeeper).options(
                name=name, num_cpus=0, max_concurrency=KEEPER_CONCURRENCY,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(node_id)
    ray.get([keeper.bytes_held.remote() for keeper in keepers.values()], timeout=timeout_s)
    return keepers


def _forget_dead(timeout_s: float) -> None:
    """Drop the handles of keepers that no longer answer (killed, or gone with their node), so a
    new one can take the name."""
    pings = {node: keeper.bytes_held.remote() for node, keeper in _STARTED.items()}
    ready, _ = ray.wait(list(pings.values()), num_returns=len(pings), timeout=timeout_s) if pings else ([], [])
    for node, ping in pings.items():
        try:
            if ping not in ready:
                raise TimeoutError(node)
            ray.get(ping)
        except Exception:  # noqa: BLE001 - dead or silent, either way it keeps nothing we can read
            _STARTED.pop(node, None)
