"""Recovery time: from a rank's death to the progress it cost being regained, from memory and from storage.

A local multi-node Ray cluster (ray.cluster_utils.Cluster: head + 2 workers, 2 logical CPUs
each) runs elastic training of the small preset (--preset; the issue names small for the blocked
goal) on 4 ranks with a durable checkpoint every --ckpt-every steps (default 10) for two
intervals, and kills mid-interval: once step 1.5 x --ckpt-every is done (15: the storage path
redoes half an interval, 5 steps, as it would on average), one rank actor's process is SIGKILLed
just after the step's line (the snapshot of that step is then still being written, so the memory
path redoes one step: its worst case); the controller notices, tears down, replans and resumes.
At 10 steps the ratio cannot reach 0.3 whatever the fixed cost of a restart: both paths pay it,
and the memory path's two steps (the one redone, the one in flight) are a third of the storage
path's six (docs/decisions.md 211). Measured per repeat, in the same run:

- storage: no snapshots; the resume reads the last durable checkpoint and redoes the steps since.
- memory: `--snapshot-every 1`; the resume reads the snapshot of the last step from the keepers.

Recovery = kill -> the step that was in flight at the kill is done again (progress regained).
Also: steps redone (completed before the kill and trained again), and the snapshot's blocked
time as a share of the step time (median over the steps of the memory runs). Printed as
medians, ending with one line:
`recovery: memory M s, storage S s, ratio R, steps redone N, snapshot blocked P%`.
Goal (issue 41): ratio <= 0.3, steps redone <= 1, snapshot blocked <= 2% at K = 1.

Then, in the same run, peer transfer: a probe actor on the head node sends one rank's snapshot
file (its size as the memory runs wrote it) to the snapshot keeper of another node the way a
snapshot write does (`put`, a bytes argument the keeper copies into its heap), against a raw copy
of the same bytes between the same two processes (the same actor call, a function that only takes
the length). Printed after the summary line:
`peer transfer: snapshot X MB/s to the other node's keeper, raw copy Y MB/s (ratio Z), B MB`.

The layout is the chooser's (dp4 for the small preset on 4 ranks); `--tp 2` pins dp2 x tp2, the
issue's, where a tp rank reads column slices of the row-parallel weights.

    .venv/bin/python bench/recovery.py [--repeats 3] [--ckpt-every 30] [--tp 2]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy  # noqa: E402
import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from rayshard.actors.snapshot.keeper import KEEPER_PREFIX  # noqa: E402
from rayshard.cluster.catalog.store import Store  # noqa: E402
from rayshard.cluster.ray_connection import ensure_auth_token  # noqa: E402
from rayshard.cluster.run.elastic import train_elastic  # noqa: E402
from rayshard.cluster.run.metrics_sinks import read_metrics  # noqa: E402
from rayshard.plans.config import CheckpointConfig, DataConfig, ModelChoice, OptimizerConfig, TrainConfig  # noqa: E402
from rayshard.plans.elastic import FailurePolicy, ScalingPolicy  # noqa: E402

# The durable interval (--ckpt-every); the run is two intervals long and the kill comes once step
# interval + interval / 2 is done, so the storage path redoes half an interval, as it would on average.
CKPT_EVERY = 10
TRANSFERS = 5  # per path; the median is printed
# Each node's object store. ray.cluster_utils' default, 150 MiB, is less than a node's snapshot
# shards in flight (2 ranks x 2 snapshots x 76.5 MB at the small preset, plus the copies arriving
# for its keeper): every snapshot then spilled to disk and was restored, which a real node (whose
# store is 30% of its memory) does not do (docs/decisions.md 206).
OBJECT_STORE_MIB = 1024
STEP_LINE = re.compile(r"^step\s+(\d+)/")


class TimedLines(io.TextIOBase):
    """The driver's console lines with the time each arrived."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []
        self._partial = ""

    def write(self, text):
        self._partial += text
        *complete, self._partial = self._partial.split("\n")
        now = time.time()
        self.lines += [(now, line) for line in complete]
        return len(text)

    def steps_done(self) -> list[tuple[float, int]]:
        return [(at, int(m.group(1))) for at, line in list(self.lines) if (m := STEP_LINE.match(line))]


def start_three_nodes(object_store_mib: int) -> Cluster:
    """A local head + 2 workers, 2 logical CPUs each and object_store_mib of object store each,
    with this process connected to it."""
    # The state API (list_actors) needs this cluster's dashboard; another cluster on a shared host
    # may hold Ray's default port 8265, so take a free one.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dashboard_port = probe.getsockname()[1]
    store_bytes = object_store_mib * 2**20
    ensure_auth_token()  # a fresh machine has no token, and Cluster makes none
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0, "object_store_memory": store_bytes,
                                                            "dashboard_port": dashboard_port})
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=0, object_store_memory=store_bytes)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    return cluster


def kill_after(ckpt_every: int) -> int:
    return ckpt_every + ckpt_every // 2


def one_recovery(store: Path, snapshot_every: int, preset: str, ckpt_every: int = CKPT_EVERY,
                 pinned: dict[str, int] | None = None) -> dict:
    config = TrainConfig(model=ModelChoice.named(preset), steps=2 * ckpt_every, global_batch=8, seq_len=32,
                         optimizer=OptimizerConfig(warmup_steps=2), data=DataConfig(max_bytes=1_000_000),
                         store=str(store), run="bench",
                         checkpoint=CheckpointConfig(every=ckpt_every, resume="auto", snapshot_every=snapshot_every))
    console, outcome = TimedLines(), {}

    def run():
        with contextlib.redirect_stdout(console):
            outcome.update(zip(("controller", "state"), train_elastic(
                config, dict(pinned or {}), ScalingPolicy(min_ranks=2), FailurePolicy(max_failures=2, backoff_s=0.0))))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    while not any(step >= kill_after(ckpt_every) for _, step in console.steps_done()):
        time.sleep(0.01)
    time.sleep(0.05)  # into the next step, while the snapshot of the step just done is still being written
    # A training rank, in the pool's placement group: not a warm spare (rank_pool.py), which holds no bundle.
    victim = max(a.pid for a in list_actors(address=ray.get_runtime_context().gcs_address, detail=True,
                                            filters=[("class_name", "=", "RankActor"), ("state", "=", "ALIVE")])
                 if a.placement_group_id)
    done_at_kill = max(step for _, step in console.steps_done())
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    thread.join(timeout=600)
    after = [(at, step) for at, step in console.steps_done() if at > killed]
    regained = next(at for at, step in after if step == done_at_kill + 1)
    metrics = read_metrics(Store(str(store)), "bench")
    blocked = [m["snapshot_blocked_s"] / m["step_s"] for m in metrics if m.get("snapshot_blocked_s") is not None]
    writes = [m["snapshot_write_s"] for m in metrics if m.get("snapshot_write_s") is not None]
    for _, line in console.lines:  # what failed, what the recovery read, which ranks it reused (rank_pool.py)
        if line.startswith(("recovery:", "[controller] restarting", "snapshot", "loaded step")):
            # A recovery line whole: it names a silent peer and where it waited (decision 217).
            print(f"  {line if line.startswith('recovery:') else line[:240]}", flush=True)
    resumed = [m for m in metrics if m.get("time", 0) > killed]  # the steps trained after the kill
    print("  steps after the kill: " + ", ".join(
        f"{m['step']} {m['step_s']:.2f} s" + (f" (snapshot blocked {m['snapshot_blocked_s']:.2f} s)"
                                               if m.get("snapshot_blocked_s") is not None else "") for m in resumed[:4]),
          flush=True)
    phases = recovery_phases(console.lines, killed, regained)
    print("  after the kill: " + ", ".join(f"{name} +{at:.2f} s" for name, at in phases.items()), flush=True)
    return {"recovery_s": regained - killed, "redone": sum(1 for _, step in after if step <= done_at_kill),
            "blocked_share": statistics.median(blocked) if blocked else 0.0,
            "step_s": statistics.median(m["step_s"] for m in metrics),
            "write_s": statistics.median(writes) if writes else 0.0}


# Where a recovery's time goes: the first console line of each phase after the kill, as the
# driver prints it (controller, rank pool, train.py), in the order they come.
PHASES = (("failure seen", "[controller] restarting"), ("replanned", "[controller] running"),
          ("ranks repaired", "recovery: ranks reused"), ("resume chosen", "resuming from"),
          ("ranks set up", "rank actors ready"), ("state loaded", "loaded step"), ("first step", "step "))


def recovery_phases(lines: list[tuple[float, str]], killed: float, regained: float) -> dict[str, float]:
    """Seconds from the kill to the first line of each phase (those that appeared), then to the
    regained step."""
    phases = {}
    for name, prefix in PHASES:
        at = next((at for at, line in lines if at > killed and (line.startswith(prefix) if prefix == "step " else prefix in line)), None)
        if at is not None:
            phases[name] = at - killed
    phases["regained"] = regained - killed
    return phases


def largest_snapshot_file() -> int:
    """The largest rank file of the snapshots the keepers hold now (bytes; 0 if none)."""
    sizes = [0]
    for name in [n for n in ray.util.list_named_actors() if n.startswith(KEEPER_PREFIX)]:
        listing = ray.get(ray.get_actor(name).listing.remote(""), timeout=60)
        sizes += [size for path, size in listing.items() if path.endswith(".safetensors")]
    return max(sizes)


@ray.remote(num_cpus=0)
class TransferProbe:
    """Sends bytes from its node to a keeper on another node, timed here (the sender's view, as a
    rank's snapshot write waits for the keepers' answers)."""

    def send(self, keeper, size: int, repeats: int) -> dict:
        payload = os.urandom(size)
        timed = {"snapshot": [], "raw": []}
        for index in range(repeats):
            for path in ("snapshot", "raw"):  # alternating: the shared machine's drift hits both
                started = time.perf_counter()
                if path == "snapshot":  # what SnapshotFileSystem.put_segments does for each holder (decision 180)
                    ref = ray.put([numpy.frombuffer(payload, dtype=numpy.uint8)])
                    ray.get(keeper.copy.remote(f"bench-transfer/{index}", [ref], size), timeout=300)
                    del ref
                else:  # the same actor-to-actor call with the plain bytes: nothing kept, no lock
                    ray.get(keeper.__ray_call__.remote(lambda _keeper, data: len(data), payload), timeout=300)
                timed[path].append(time.perf_counter() - started)
        ray.get(keeper.remove.remote("bench-transfer/"), timeout=300)
        return {path: size / statistics.median(seconds) for path, seconds in timed.items()}


def peer_transfer(size: int) -> dict:
    """Bytes/s from the head node to another node's keeper: snapshot write against raw copy."""
    head = ray.get_runtime_context().get_node_id()
    peers = [n for n in ray.util.list_named_actors() if n.startswith(KEEPER_PREFIX) and not n.endswith(head)]
    probe = TransferProbe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(head, soft=False)).remote()
    try:
        return ray.get(probe.send.remote(ray.get_actor(peers[0]), size, TRANSFERS), timeout=900)
    finally:
        ray.kill(probe)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--preset", default="small", help="model preset (issue 41: small)")
    parser.add_argument("--only", choices=("memory", "storage"), help="run one path only (iterating; no ratio)")
    parser.add_argument("--ckpt-every", type=int, default=CKPT_EVERY,
                        help="durable checkpoint interval in steps; the storage path redoes half of it")
    parser.add_argument("--object-store-mib", type=int, default=OBJECT_STORE_MIB,
                        help="each node's object store (150 is ray.cluster_utils' default, where snapshots spill to disk)")
    parser.add_argument("--tp", type=int, default=0,
                        help="pin tensor parallelism (2: dp2 x tp2, the issue's layout; 0: the layout chooser's, dp4 on small)")
    args = parser.parse_args()
    cluster = start_three_nodes(args.object_store_mib)
    results, file_bytes = {"storage": [], "memory": []}, 0
    for repeat in range(args.repeats):
        for mode, every in (("storage", 0), ("memory", 1)):  # alternating: the machine's drift hits both
            if args.only not in (None, mode):
                continue
            with tempfile.TemporaryDirectory() as store:
                r = one_recovery(Path(store), every, args.preset, args.ckpt_every, {"tp": args.tp} if args.tp else None)
                if mode == "memory":
                    file_bytes = max(file_bytes, largest_snapshot_file())
            results[mode].append(r)
            print(f"repeat {repeat + 1} {mode:7s}: progress regained {r['recovery_s']:.2f} s after the kill, "
                  f"{r['redone']} step(s) redone, step {r['step_s']:.3f} s" + (f", snapshot blocked {100 * r['blocked_share']:.1f}% of a step, "
                                                     f"written to the keepers in {r['write_s']:.2f} s"
                                                     if mode == "memory" else ""), flush=True)
    median = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for mode, rs in results.items() if rs}
    if args.only:
        print(f"{args.only}: progress regained {median[args.only]['recovery_s']:.2f} s after the kill (median)")
    else:
        summarise(args, median, file_bytes)
    ray.shutdown()
    with contextlib.suppress(AttributeError):
        cluster.shutdown()


def summarise(args, median: dict, file_bytes: int) -> None:
    memory, storage = median["memory"], median["storage"]
    print(f"\n{args.preset} preset, 4 ranks{f' (tp{args.tp} pinned)' if args.tp else ''} on a 3-node local cluster, checkpoint every {args.ckpt_every}, kill after "
          f"step {kill_after(args.ckpt_every)}, {args.repeats} repeats (medians)")
    print(f"step time (median): {memory['step_s']:.3f} s with snapshots every step, {storage['step_s']:.3f} s without; "
          f"a snapshot's slowest rank writes it to the keepers in {memory['write_s']:.2f} s")
    print(f"recovery: memory {memory['recovery_s']:.2f} s, storage {storage['recovery_s']:.2f} s, ratio "
          f"{memory['recovery_s'] / storage['recovery_s']:.2f}, steps redone {memory['redone']:g}, snapshot blocked "
          f"{100 * memory['blocked_share']:.1f}%")
    rates = peer_transfer(file_bytes or 64 * 2**20)
    print(f"peer transfer: snapshot {rates['snapshot'] / 1e6:.0f} MB/s to the other node's keeper, raw copy "
          f"{rates['raw'] / 1e6:.0f} MB/s (ratio {rates['snapshot'] / rates['raw']:.2f}), "
          f"{(file_bytes or 64 * 2**20) / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
    main()
