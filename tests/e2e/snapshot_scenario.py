"""Recovery from snapshots in memory on a multi-node local Ray cluster (issue 41).

    python tests/e2e/snapshot_scenario.py OUT.json --fault rank|rank-twice|node|both-holders [--steps N]

A ray.cluster_utils.Cluster (a head with 2 logical CPUs and two worker nodes with 1 each, one
rank per CPU) runs elastic training of the tiny preset on 4 ranks with a snapshot every step and
a durable checkpoint only at the end, so a failure can only be recovered from memory or from the
start. The fault lands once step KILL_AT's snapshot is committed, mid-step:

- rank: one rank actor's process is SIGKILLed (layout pinned to dp2 x tp2); the run resumes on
  the same cluster and layout.
- rank-twice: as rank, then a second rank (one the recovery reused) is SIGKILLed while the run
  recovers: once the rank pool has said which ranks it reused and restarted, before any step of
  the new attempt; the run recovers again.
- node: a worker node is removed (its rank, its keeper and the copies it held); the run resumes
  on the 3 ranks left, another layout, resharded from the surviving copies.
- both-holders: the two keepers holding both copies of rank 0's snapshot file are killed with
  the rank: the snapshot is no longer whole, so the recovery falls back (to the start: there is
  no durable checkpoint yet) and says so.

Then the same config trains uninterrupted on the first attempt's layout (a fresh run name) as
the reference. Writes the controller's history, both runs' losses, the metrics' snapshot fields
and the driver's console lines to OUT.json.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from rayshard.cluster.catalog.snapshot_record import read_snapshot_record  # noqa: E402
from rayshard.cluster.catalog.store import Store  # noqa: E402
from rayshard.cluster.ray_connection import ensure_auth_token  # noqa: E402
from rayshard.cluster.run.elastic import train_elastic  # noqa: E402
from rayshard.cluster.run.train import train  # noqa: E402
from rayshard.plans.layout.parallel_layout import ParallelLayout  # noqa: E402
from rayshard.cluster.run.metrics_sinks import read_metrics  # noqa: E402
from rayshard.cluster.run.snapshots import snapshot_store_url  # noqa: E402
from rayshard.plans.config import CheckpointConfig, DataConfig, ModelChoice, OptimizerConfig, TrainConfig  # noqa: E402
from rayshard.plans.elastic import FailurePolicy, ScalingPolicy  # noqa: E402

RUN, KILL_AT = "hot", 4


def config_for(store: str, steps: int) -> TrainConfig:
    return TrainConfig(model=ModelChoice.named("tiny"), steps=steps, global_batch=12, seq_len=32, seed=11,
                       optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2),
                       data=DataConfig(max_bytes=1_000_000), store=store, run=RUN,
                       checkpoint=CheckpointConfig(every=0, resume="auto", snapshot_every=1))


def snapshot_step(store: str) -> int:
    """The newest committed snapshot's step (0 if none yet), read through the keepers."""
    snapshots = Store(snapshot_store_url(store))
    steps = snapshots.committed_steps(RUN)
    return steps[-1] if steps else 0


def rank_pids() -> list[tuple[int, str]]:
    """The live training rank actors' processes. The state API goes through the dashboard, which a loaded
    machine may start late: asked again for up to a minute."""
    for attempt in range(12):
        try:
            actors = list_actors(address=ray.get_runtime_context().gcs_address, detail=True,
                                 filters=[("class_name", "=", "RankActor"), ("state", "=", "ALIVE")])
            # Training ranks: in the pool's placement group, not its warm spares (decision 185).
            return sorted((a.pid, a.node_id) for a in actors if a.placement_group_id)
        except ConnectionError:
            if attempt == 11:
                raise
            time.sleep(5)
    return []


def holders_of_rank_zero(step: int) -> list[str]:
    """The keepers (by actor name) holding rank 0's shard of the snapshot of `step`."""
    from rayshard.actors.snapshot.keeper import KEEPER_PREFIX
    found = []
    for name in [n for n in ray.util.list_named_actors() if n.startswith(KEEPER_PREFIX)]:
        try:
            listing = ray.get(ray.get_actor(name).listing.remote(""), timeout=30)
        except Exception:  # noqa: BLE001 - a killed keeper
            continue
        if any(f"step-{step:08d}/" in path and path.endswith("rank-00000.safetensors") for path in listing):
            found.append(name)
    return found


class Tee(io.TextIOBase):
    """The driver's console, kept: the recovery lines are part of what the test checks."""

    def __init__(self, stream):
        self.stream, self.lines, self.times = stream, [], []

    def write(self, text):
        self.lines.append(text)
        self.times.append(time.time())
        return self.stream.write(text)

    def first_step_times(self) -> dict[int, float]:
        """When each step's line was first printed (a redone step keeps its first time)."""
        first: dict[int, float] = {}
        for at, text in zip(self.times, self.lines):
            for line in text.splitlines():
                match = re.match(r"step\s+(\d+)/", line)
                if match:
                    first.setdefault(int(match.group(1)), at)
        return first

    def flush(self):
        self.stream.flush()


def kill_while_recovering(tee: Tee, first_victim: int, deadline: float) -> dict:
    """SIGKILL a rank the recovery reuses as soon as the rank pool has named the ranks it reused
    and restarted: the new attempt is then setting up or loading, before its first step. Which
    ranks are reused is the pool's choice (silent peers may be replaced by warm spares, decision
    185), so the victim is picked then: a training rank still alive in the pool's placement group
    (spares run outside it), other than the first victim."""
    seen = len(tee.lines)
    while time.time() < deadline:
        text = "".join(tee.lines[seen:])
        if "recovery: ranks reused" in text:
            reused = [pid for pid, _ in rank_pids() if pid != first_victim]
            if not reused:
                return {"event": "rank-again", "at": None, "steps_before": None, "why": "no rank was reused"}
            os.kill(reused[0], signal.SIGKILL)
            # Step lines of the new attempt printed before this kill (0: it landed during the recovery).
            after = "".join(tee.lines[seen:])
            return {"event": "rank-again", "at": time.time(),
                    "steps_before": sum(1 for line in after.splitlines() if line.startswith("step "))}
        time.sleep(0.005)
    return {"event": "rank-again", "at": None, "steps_before": None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fault", choices=("rank", "rank-twice", "node", "both-holders"), default="rank")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    ensure_auth_token()  # a fresh machine has no token, and Cluster makes none
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    workers = [cluster.add_node(num_cpus=1, num_gpus=0) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    store = tempfile.mkdtemp(prefix="rayshard-hot-")
    config = config_for(store, args.steps)
    outcome, events = {}, []
    tee = Tee(sys.stdout)

    def run():
        with contextlib.redirect_stdout(tee):
            outcome.update(zip(("controller", "state"), train_elastic(
                config, {"dp": 2, "tp": 2} if args.fault.startswith("rank") else {},
                ScalingPolicy(min_ranks=2), FailurePolicy(max_failures=3, backoff_s=0.0), cpus_per_rank=1.0)))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.time() + 300
    while snapshot_step(store) < KILL_AT and time.time() < deadline and thread.is_alive():
        time.sleep(0.05)
    events.append({"event": args.fault, "snapshot_step": snapshot_step(store), "at": time.time()})
    if args.fault == "node":
        cluster.remove_node(workers[0])
    else:
        if args.fault == "both-holders":
            doomed = holders_of_rank_zero(KILL_AT)
            for name in doomed:
                ray.kill(ray.get_actor(name))
            events[-1]["killed_keepers"] = len(doomed)
        pids = [pid for pid, _ in rank_pids()]
        os.kill(pids[-1], signal.SIGKILL)
        if args.fault == "rank-twice":
            events.append(kill_while_recovering(tee, pids[-1], time.time() + 300))
    thread.join(timeout=900)
    metrics = read_metrics(Store(store), RUN)
    history = [{"state": t.state.value, "detail": t.detail, "at": t.at_wall} for t in outcome["controller"].history]
    first_layout = ParallelLayout.parse(metrics[0]["layout"])
    with contextlib.redirect_stdout(tee):
        reference = train(replace(config, run="reference", layout=first_layout,
                                  checkpoint=replace(config.checkpoint, resume=None, snapshot_every=0),
                                  resources=replace(config.resources, cpus_per_rank=0.5)))
    json.dump({"state": outcome.get("state"), "history": history, "events": events,
               "losses": {m["step"]: m["loss"] for m in metrics}, "layouts": {m["step"]: m["layout"] for m in metrics},
               "reference": reference.losses, "step_times": tee.first_step_times(),
               "snapshot_steps": {m["step"]: m.get("snapshot_step") for m in metrics},
               "snapshot_nodes": {m["step"]: m.get("snapshot_nodes") for m in metrics},
               "snapshot_record": read_snapshot_record(Store(store), RUN),
               "log": "".join(tee.lines).splitlines()}, open(args.out, "w"), indent=1, default=str)
    ray.shutdown()
    with contextlib.suppress(Exception):
        cluster.shutdown()


if __name__ == "__main__":
    main()
