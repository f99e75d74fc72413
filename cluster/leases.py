"""Reader leases: a marker that a checkpoint is being read, so `ckpt gc` leaves it alone.

    {store}/{run}/leases/step-00000020/<lease id>.json     {"expires_unix": ..., "holder": ...}

Object stores have no locks, so a lease is an object with an expiry: a reader that dies leaves a
lease that simply expires, and gc deletes expired ones. A reader creates its lease *before* it
looks at the checkpoint again (see `reading`), so a gc that lists leases after that moment keeps
the checkpoint; gc also never deletes LATEST and keeps anything younger than its grace period,
which covers a reader that resolved a checkpoint but has not taken its lease yet.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass

from plans.errors import CheckpointError

DEFAULT_TTL_S = 6 * 3600.0


@dataclass(frozen=True)
class Lease:
    run: str
    step: int
    path: str
    expires_unix: float
    holder: str


def lease_dir(store, run: str, step: int) -> str:
    from cluster.store import step_dirname

    return f"{store.root}/{run}/leases/{step_dirname(step)}"


def acquire(store, run: str, step: int, ttl_s: float = DEFAULT_TTL_S, holder: str | None = None) -> Lease:
    holder = holder or f"{socket.gethostname()}:{os.getpid()}"
    path = f"{lease_dir(store, run, step)}/{uuid.uuid4().hex}.json"
    expires = time.time() + ttl_s
    store.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    store.fs.pipe_file(path, json.dumps({"expires_unix": expires, "holder": holder}).encode())
    return Lease(run, step, path, expires, holder)


def release(store, lease: Lease) -> None:
    with contextlib.suppress(FileNotFoundError):
        store.fs.rm_file(lease.path)


def active(store, run: str, now: float | None = None) -> dict[int, list[Lease]]:
    """Unexpired leases of a run, by step."""
    return {step: [lease for lease in leases if lease.expires_unix > (now or time.time())]
            for step, leases in all_leases(store, run).items()}


def all_leases(store, run: str) -> dict[int, list[Lease]]:
    from cluster.store import STEP_DIR

    base = f"{store.root}/{run}/leases"
    if not store.fs.exists(base):
        return {}
    paths = [p for p in store.fs.find(base) if p.endswith(".json")]
    contents = store.fs.cat(paths, on_error="omit") if paths else {}
    found: dict[int, list[Lease]] = {}
    for path, data in contents.items():
        match = STEP_DIR.match(path.rsplit("/", 2)[-2])
        if not match:
            continue
        try:
            document = json.loads(data)
            lease = Lease(run, int(match.group(1)), path, float(document["expires_unix"]), str(document.get("holder", "?")))
        except (ValueError, KeyError, TypeError):
            lease = Lease(run, int(match.group(1)), path, 0.0, "unreadable")  # expired: gc removes it
        found.setdefault(lease.step, []).append(lease)
    return found


@contextlib.contextmanager
def reading(store, ref, ttl_s: float = DEFAULT_TTL_S):
    """Hold a lease on a committed checkpoint (a CheckpointRef with run and step) while reading
    it. A ref given by URL (no run/step known) is read without a lease."""
    if ref.run is None or ref.step is None:
        yield None
        return
    lease = acquire(store, ref.run, ref.step, ttl_s)
    try:
        if ref.step not in store.committed_steps(ref.run):  # gc may have won the race before our lease
            raise CheckpointError(f"{ref.run}@{ref.step} was removed (by `ckpt gc`?) before it could be read. "
                                  f"Fix: resume from a checkpoint that exists: {store.committed_steps(ref.run) or 'none'}")
        yield lease
    finally:
        release(store, lease)
