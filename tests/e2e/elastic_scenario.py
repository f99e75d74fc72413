"""Run elastic training on a multi-node local Ray cluster while injecting faults.

    python tests/e2e/elastic_scenario.py STORE OUT.json

A ray.cluster_utils.Cluster with a head and three worker nodes (2 logical CPUs each, one rank
per CPU) starts the run on 8 ranks. Once checkpoints exist, a fault injector SIGKILLs a rank
actor's process, later removes a worker node, later adds one back. The controller must resume
from LATEST each time on what remains (and grow at a checkpoint when the node returns).
Writes the controller's history, the injected events and the run's metrics to OUT.json.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from cluster.elastic import train_elastic  # noqa: E402
from plans.config import DataConfig, OptimizerConfig, TrainConfig  # noqa: E402
from plans.elastic import FailurePolicy, ScalingPolicy  # noqa: E402
from plans.model_spec import preset  # noqa: E402

STEPS, EVERY = 14, 2


def scenario_config(store: str) -> TrainConfig:
    return TrainConfig(model=preset("tiny"), steps=STEPS, ckpt_every=EVERY, global_batch=8, seq_len=32, seed=7,
                       optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3),
                       data=DataConfig(max_bytes=1_000_000), store=store, run="elastic", resume="auto")


def latest_step(store: str) -> int:
    path = Path(store) / "elastic" / "LATEST"
    return int(path.read_text().strip().split("-")[1]) if path.exists() else 0


def wait_for_checkpoint(store: str, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while latest_step(store) < step:
        if time.time() > deadline:
            raise TimeoutError(f"no checkpoint at step {step} within {timeout}s")
        time.sleep(0.2)


def rank_actor_pids() -> list[int]:
    actors = list_actors(filters=[("class_name", "=", "RankActor"), ("state", "=", "ALIVE")], detail=True)
    return sorted(a.pid for a in actors if a.pid)


def inject_faults(cluster: Cluster, workers: list, store: str, events: list) -> None:
    wait_for_checkpoint(store, 2)
    time.sleep(0.5)  # mid-step
    pid = rank_actor_pids()[-1]
    os.kill(pid, signal.SIGKILL)
    events.append({"event": "kill_rank", "pid": pid, "after_checkpoint": latest_step(store), "at": time.time()})
    wait_for_checkpoint(store, 6)
    time.sleep(0.5)
    cluster.remove_node(workers.pop())
    events.append({"event": "remove_node", "after_checkpoint": latest_step(store), "at": time.time()})
    wait_for_checkpoint(store, 8)
    workers.append(cluster.add_node(num_cpus=2))
    events.append({"event": "add_node", "after_checkpoint": latest_step(store), "at": time.time()})


def main(store: str, out: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    workers = [cluster.add_node(num_cpus=2) for _ in range(3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    events: list[dict] = []
    outcome: dict = {}

    def run_training():
        outcome["controller"], outcome["state"] = train_elastic(
            scenario_config(store), pinned={}, scaling=ScalingPolicy(min_ranks=2, max_ranks=8),
            failure=FailurePolicy(max_failures=4, backoff_s=0.5))

    # Training runs in a thread: Cluster.add_node installs signal handlers, so faults are
    # injected from the main thread.
    trainer = threading.Thread(target=run_training, daemon=True)
    trainer.start()
    inject_faults(cluster, workers, store, events)
    trainer.join(timeout=600)
    controller, state = outcome["controller"], outcome["state"]
    metrics = [json.loads(line) for line in (Path(store) / "elastic" / "metrics.jsonl").read_text().splitlines() if line]
    Path(out).write_text(json.dumps({
        "state": state.value,
        "history": [{"state": t.state.value, "detail": t.detail, "at": t.at_wall} for t in controller.history],
        "events": events,
        "metrics": metrics,
    }, indent=1))
    ray.shutdown()
    try:
        cluster.shutdown()
    except AttributeError:  # Ray 2.60's Cluster.shutdown trips over a node removed earlier
        pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
