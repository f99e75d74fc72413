"""Recovery time: from a rank's death to the first step trained after resuming.

A local multi-node Ray cluster (ray.cluster_utils.Cluster: head + 2 workers, 2 logical CPUs
each) runs elastic training of the tiny preset; once a checkpoint is committed, one rank
actor's process is SIGKILLed mid-step. The controller notices, tears down, replans and resumes
from LATEST. Printed per repeat and as medians: detection (kill -> controller restarting),
relaunch (-> the controller has replanned and starts the new attempt) and the whole recovery (kill -> first resumed step
finished). Goal: under 30 s here.

    .venv/bin/python bench/recovery.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from rayshard.cluster.catalog.store import Store  # noqa: E402
from rayshard.cluster.run.elastic import train_elastic  # noqa: E402
from rayshard.cluster.run.metrics_sinks import read_metrics  # noqa: E402
from rayshard.plans.config import CheckpointConfig, DataConfig, ModelChoice, OptimizerConfig, TrainConfig  # noqa: E402
from rayshard.plans.elastic import FailurePolicy, ScalingPolicy  # noqa: E402


def _latest(store: Path) -> int:
    path = store / "bench" / "LATEST"
    return int(path.read_text().split("-")[1]) if path.exists() else 0


def one_recovery(store: Path) -> dict:
    config = TrainConfig(model=ModelChoice.named("tiny"), steps=8, global_batch=8, seq_len=32,
                         optimizer=OptimizerConfig(warmup_steps=2), data=DataConfig(max_bytes=1_000_000),
                         store=str(store), run="bench", checkpoint=CheckpointConfig(every=2, resume="auto"))
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.update(zip(("controller", "state"), train_elastic(
        config, {}, ScalingPolicy(min_ranks=2), FailurePolicy(max_failures=2, backoff_s=0.0)))), daemon=True)
    thread.start()
    while _latest(store) < 2:
        time.sleep(0.05)
    time.sleep(0.2)  # mid-step
    victim = max(a.pid for a in list_actors(address=ray.get_runtime_context().gcs_address, detail=True,
                                            filters=[("class_name", "=", "RankActor"), ("state", "=", "ALIVE")]))
    checkpoint_at_kill = _latest(store)
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=600)
    history = outcome["controller"].history
    restarting = next(t.at_wall for t in history if t.state.value == "restarting")
    running_again = [t.at_wall for t in history if t.state.value == "running"][1]
    metrics = read_metrics(Store(str(store)), "bench")  # the current timeline: the resumed attempt's steps
    first_resumed = next(m["time"] for m in metrics if m["step"] == checkpoint_at_kill + 1)
    return {"detect_s": restarting - killed, "restart_s": running_again - killed, "recovery_s": first_resumed - killed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=0)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    results = []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory() as store:
            results.append(one_recovery(Path(store)))
        r = results[-1]
        print(f"repeat {repeat + 1}: detected {r['detect_s']:.1f}s, relaunched {r['restart_s']:.1f}s, "
              f"first resumed step {r['recovery_s']:.1f}s after the kill", flush=True)
    median = {key: statistics.median(r[key] for r in results) for key in results[0]}
    print(f"\ntiny preset, 4 ranks on a 3-node local cluster, {args.repeats} repeats (medians):")
    print(f"  failure detected after          {median['detect_s']:6.1f} s")
    print(f"  new attempt launched after       {median['restart_s']:6.1f} s")
    print(f"  first resumed step done after    {median['recovery_s']:6.1f} s   (goal < 30 s)")
    ray.shutdown()
    try:
        cluster.shutdown()
    except AttributeError:
        pass


if __name__ == "__main__":
    main()
