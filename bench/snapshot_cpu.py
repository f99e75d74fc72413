"""Where the CPU goes per training step with snapshots every step, by process role.

The same 3-node local cluster as bench/recovery.py (ray.cluster_utils.Cluster: head + 2
workers, 2 logical CPUs each; a free dashboard port), the small preset on 4 ranks for STEPS steps,
once with `--snapshot-every 1` and once without (alternated over --repeats). A sampler thread reads
the CPU times (user + system) of every process of the cluster (the driver's descendants: gcs,
raylets with their plasma store and object manager, workers) every SAMPLE_S, and each process is
given a role from its command line. Printed: CPU-seconds per step by role over the steps between
the FIRST_STEP'th and the last one's console lines (no start-up, no final checkpoint), with and
without snapshots, and the step's wall time.

    RAY_local_fs_capacity_threshold=0.99 RAY_AUTH_MODE=token PYTHONPATH=$PWD .venv/bin/python bench/snapshot_cpu.py
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench whose cluster and console capture this shares

import psutil  # noqa: E402
import ray  # noqa: E402

from rayshard.cluster.run.elastic import train_elastic  # noqa: E402
from rayshard.plans.config import CheckpointConfig, DataConfig, ModelChoice, OptimizerConfig, TrainConfig  # noqa: E402
from rayshard.plans.elastic import FailurePolicy, ScalingPolicy  # noqa: E402
from recovery import OBJECT_STORE_MIB, TimedLines, start_three_nodes  # noqa: E402

STEPS, FIRST_STEP = 10, 2  # CPU counted from step FIRST_STEP's line to step STEPS - 1's (the last step saves durably)
SAMPLE_S = 0.25
FINAL_ROLES = ("rank actors", "snapshot keepers", "gcs", "driver")  # the others may still change their title
THREADED = ("snapshot keepers", "raylets (+ plasma, object manager)")  # broken down by thread with RAYSHARD_DEBUG=1
ROLES = ("rank actors", "snapshot keepers", "spill/restore workers", "other ray workers", "raylets (+ plasma, object manager)", "gcs",
         "other ray services", "driver")


def role_of(process: psutil.Process, driver: int) -> str:
    if process.pid == driver:
        return "driver"
    try:
        line = " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "other ray services"
    if line.startswith("ray::RankActor"):
        return "rank actors"
    if line.startswith("ray::SnapshotKeeper"):
        return "snapshot keepers"
    if line.startswith("ray::") and ("Spill" in line or "Restore" in line or "SPILL" in line or "RESTORE" in line):
        return "spill/restore workers"
    if line.startswith("ray::"):
        return "other ray workers"
    if "/raylet" in line.split(" ")[0]:
        return "raylets (+ plasma, object manager)"
    if "gcs_server" in line.split(" ")[0]:
        return "gcs"
    return "other ray services"


class Sampler(threading.Thread):
    """Every process under the driver: (time, {pid: (role, cpu seconds)}) every SAMPLE_S."""

    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, dict[int, float]]] = []
        self.roles: dict[int, str] = {}
        self.titles: dict[int, str] = {}  # pid -> its command line's first word, as last seen
        self.threads: list[tuple[float, dict[tuple[int, int], tuple[str, float]]]] = []  # keepers', raylets'
        self.faults: list[tuple[float, dict[int, int]]] = []  # minor page faults by pid
        self.stop = threading.Event()

    def sample(self) -> None:
        driver = psutil.Process(os.getpid())
        now, seen, threads, faults = time.time(), {}, {}, {}
        for process in [driver, *driver.children(recursive=True)]:
            try:
                times = process.cpu_times()
                if self.roles.get(process.pid) not in FINAL_ROLES:
                    # a worker is forked by its raylet (and shows the raylet's command line), then
                    # runs python, then shows `ray::IDLE`, then names its actor
                    self.roles[process.pid] = role_of(process, driver.pid)
                    with contextlib.suppress(psutil.Error, IndexError):
                        self.titles[process.pid] = process.cmdline()[0].split(" ")[0][-40:]
                seen[process.pid] = times.user + times.system
                with contextlib.suppress(OSError, IndexError, ValueError):  # minor page faults, field 10 of stat
                    faults[process.pid] = int(Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
                if self.roles[process.pid] in THREADED:
                    for thread in process.threads():
                        with contextlib.suppress(OSError):
                            comm = Path(f"/proc/{process.pid}/task/{thread.id}/comm").read_text().strip()
                            threads[(process.pid, thread.id)] = (comm, thread.user_time + thread.system_time)
            except psutil.Error:
                continue
        self.samples.append((now, seen))
        self.threads.append((now, threads))
        self.faults.append((now, faults))

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            time.sleep(SAMPLE_S)

    def cpu_between(self, start: float, end: float) -> dict[str, float]:
        return self._by_role(self.samples, start, end)

    def faults_between(self, start: float, end: float) -> dict[str, float]:
        return self._by_role(self.faults, start, end)

    def _by_role(self, samples, start: float, end: float) -> dict[str, float]:
        """CPU seconds by role from the first sample at or after start to the first at or after end
        (a process born between counts from zero; one that died counts to its last sample), each
        process under the last role it showed."""
        first = next(seen for at, seen in samples if at >= start)
        end_at = next(at for at, _ in samples if at >= end)
        last: dict[int, float] = {}
        for at, seen in samples:
            if start <= at <= end_at:
                last.update(seen)
        by_role: dict[str, float] = defaultdict(float)
        for pid, cpu in last.items():
            by_role[self.roles[pid]] += cpu - first.get(pid, 0.0)
        return dict(by_role)


    def threads_between(self, start: float, end: float) -> dict[str, float]:
        """CPU seconds of the keepers' and raylets' threads by (role, thread name), as cpu_between."""
        first = next(seen for at, seen in self.threads if at >= start)
        end_at = next(at for at, _ in self.threads if at >= end)
        last: dict[tuple[int, int], tuple[str, float]] = {}
        for at, seen in self.threads:
            if start <= at <= end_at:
                last.update(seen)
        by_thread: dict[str, float] = defaultdict(float)
        for key, (comm, cpu) in last.items():
            by_thread[f"{self.roles[key[0]].split(' ')[0]} {re.sub(r'[0-9]+$', '', comm)}"] += cpu - first.get(key, (comm, 0.0))[1]
        return dict(by_thread)


def one_run(store: Path, snapshot_every: int, preset: str) -> dict:
    config = TrainConfig(model=ModelChoice.named(preset), steps=STEPS, global_batch=8, seq_len=32,
                         optimizer=OptimizerConfig(warmup_steps=2), data=DataConfig(max_bytes=1_000_000),
                         store=str(store), run="bench",
                         checkpoint=CheckpointConfig(every=STEPS, resume="auto", snapshot_every=snapshot_every))
    console, sampler = TimedLines(), Sampler()
    sampler.start()
    try:
        with contextlib.redirect_stdout(console):
            train_elastic(config, {}, ScalingPolicy(min_ranks=2), FailurePolicy(max_failures=2, backoff_s=0.0))
    finally:
        sampler.stop.set()
        sampler.join()
    steps = {step: at for at, step in console.steps_done()}
    start, end = steps[FIRST_STEP], steps[STEPS - 1]
    n = STEPS - 1 - FIRST_STEP
    if os.environ.get("RAYSHARD_DEBUG"):
        print("  processes: " + str(sorted(set((role, sampler.titles.get(pid, "?")) for pid, role in sampler.roles.items()))), flush=True)
    if os.environ.get("RAYSHARD_DEBUG"):  # where inside the keepers and raylets
        threads = sorted(sampler.threads_between(start, end).items(), key=lambda item: -item[1])
        faults = sampler.faults_between(start, end)
        print("  minor page faults per step: " + ", ".join(f"{role} {count / n:.0f}" for role, count in faults.items()), flush=True)
        print("  threads (CPU s/step): " + ", ".join(f"{name} {cpu / n:.3f}" for name, cpu in threads if cpu / n >= 0.01), flush=True)
    return {"per_step": {role: cpu / n for role, cpu in sampler.cpu_between(start, end).items()},
            "step_s": (end - start) / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--object-store-mib", type=int, default=OBJECT_STORE_MIB,
                        help="each node's object store (150: ray.cluster_utils' default, where snapshots spill)")
    args = parser.parse_args()
    cluster = start_three_nodes(args.object_store_mib)
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    try:
        for repeat in range(args.repeats):
            for mode, every in (("without", 0), ("with", 1)):  # alternated: the host's drift hits both
                with tempfile.TemporaryDirectory() as store:
                    result = one_run(Path(store), every, args.preset)
                runs[mode].append(result)
                load = os.getloadavg()
                print(f"repeat {repeat + 1} {mode:7s} snapshots: step {result['step_s']:.3f} s, "
                      f"CPU {sum(result['per_step'].values()):.2f} s/step (load {load[0]:.1f} {load[1]:.1f})", flush=True)
    finally:
        ray.shutdown()
        with contextlib.suppress(AttributeError):
            cluster.shutdown()
    print(f"\nCPU-seconds per step by role ({args.preset} preset, 4 ranks, 3-node local cluster with "
          f"{args.object_store_mib} MiB object stores, steps "
          f"{FIRST_STEP + 1}-{STEPS - 1}, mean over {args.repeats} repeat(s))")
    print("| role | without snapshots | with snapshots (every step) | difference |\n|---|---|---|---|")
    mean = {mode: {role: sum(r["per_step"].get(role, 0.0) for r in rs) / len(rs) for role in ROLES}
            for mode, rs in runs.items()}
    for role in ROLES:
        print(f"| {role} | {mean['without'][role]:.2f} | {mean['with'][role]:.2f} | "
              f"{mean['with'][role] - mean['without'][role]:+.2f} |")
    total = {mode: sum(values.values()) for mode, values in mean.items()}
    step = {mode: sum(r["step_s"] for r in rs) / len(rs) for mode, rs in runs.items()}
    print(f"| all | {total['without']:.2f} | {total['with']:.2f} | {total['with'] - total['without']:+.2f} |")
    print(f"| step wall time | {step['without']:.2f} s | {step['with']:.2f} s | x{step['with'] / step['without']:.2f} |")


if __name__ == "__main__":
    main()
