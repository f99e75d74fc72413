"""The run's note of its newest snapshot in memory, kept in the store for people to read.

Snapshots live in the snapshot keepers (Ray actors), which a `rayshard ckpt ls` on a laptop cannot
reach; so the driver leaves a small JSON note beside the run (`<run>/SNAPSHOT.json`): the step,
when it was taken and the nodes keeping its copies. At most one write every RECORD_EVERY_S, so a
snapshot every step does not mean an object-store write every step. Reading it needs neither
torch nor Ray.
"""
from __future__ import annotations

import json
import time

RECORD = "SNAPSHOT.json"
RECORD_EVERY_S = 10.0


def write_snapshot_record(store, run: str, step: int, taken_unix: float, nodes: list[str]) -> None:
    store.write_text(f"{run}/{RECORD}", json.dumps({"step": step, "taken_unix": taken_unix, "nodes": sorted(nodes)}))


def read_snapshot_record(store, run: str) -> dict | None:
    """The note, or None when the run never took a snapshot (or the note is not JSON)."""
    text = store.read_text(f"{run}/{RECORD}")
    if not text:
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def describe_snapshot_record(run: str, record: dict, now: float | None = None) -> str:
    """One line for `ckpt ls`."""
    age = max(0.0, (now or time.time()) - float(record.get("taken_unix", 0)))
    nodes = ", ".join(str(node)[:12] for node in record.get("nodes", [])) or "unknown nodes"
    return (f"snapshot in memory: {run}@{record['step']}, taken {age:.0f} s ago, copies on {nodes} "
            "(not durable: kept by the job's snapshot keepers while it runs)")
