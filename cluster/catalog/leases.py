"""Reader leases: a marker that a checkpoint is being read, so `ckpt gc` leaves it alone.

    {store}/{run}/leases/step-00000020/<lease id>.json     {"expires_unix": ..., "holder": ...}

Object stores have no locks, so a lease is an object with an expiry: a reader that dies leaves a
lease that simply expires, and gc deletes expired ones. A reader creates its lease *before* it
looks at the checkpoint's manifest again (see `reading`); gc removes the manifest *before* it
looks at the step's leases again, and puts the manifest back if it finds one
(`retention._remove_checkpoint`). Whichever of the two goes second sees the other, so a reader
that found the manifest keeps its checkpoint, and one that did not is told it was removed. gc
also never deletes LATEST's checkpoint.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass

from rayshard.cluster.catalog.store import STEP_DIR, step_dirname
from rayshard.plans.errors import CheckpointError

DEFAULT_TTL_S = 6 * 3600.0


@dataclass(frozen=True)
class Lease:
    run: str
    step: int
    path: str
    expires_unix: float
    holder: str


def lease_dir(store, run: str, step: int) -> str:
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


def held(store, run: str, step: int, now: float | None = None) -> list[Lease]:
    """Unexpired leases of one step, from its own directory (gc's second look, per checkpoint it
    removes: one listing of that step, not of every step's)."""
    return [lease for lease in _leases_under(store, run, lease_dir(store, run, step)).get(step, [])
            if lease.expires_unix > (now or time.time())]


def all_leases(store, run: str) -> dict[int, list[Lease]]:
    return _leases_under(store, run, f"{store.root}/{run}/leases")


def _leases_under(store, run: str, base: str) -> dict[int, list[Lease]]:
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
def reading(store, ref, ttl_s: float = DEFAULT_TTL_S, optional: bool = False):
    """Hold a lease on a committed checkpoint while reading it. A ref given by URL is leased too
    when the URL is a catalog checkpoint (`<store>/<run>/checkpoints/step-NNNNNNNN`): the lease
    goes beside the checkpoint, in the store that holds it, whatever store the command named.
    Any other directory (an import's output, a copy made by hand) has no catalog to lease in.
    optional: a lease that cannot be written (a full disk, read-only credentials) is a warning,
    not an error: for a command that only checks what it reads (`ckpt verify`), which a full
    disk is a reason to run, not a reason to refuse."""
    by_url = ref.run is None or ref.step is None
    try:
        home, run, step = _home(store, ref)
        lease = acquire(home, run, step, ttl_s) if home is not None else None
    except OSError as error:  # PermissionError among them: read-only credentials
        if not (by_url or optional):
            raise
        # Reading a checkpoint by URL needs only read access; a lease is a courtesy to gc there.
        print(f"rayshard: warning: reading {ref.url} without a reader lease ({type(error).__name__}: "
              f"{str(error).splitlines()[0] if str(error) else 'no detail'}): `ckpt gc` on its store could remove it "
              "meanwhile", file=sys.stderr)
        home, lease = None, None
    if lease is None:
        yield None
        return
    try:
        if not home.is_committed(run, step):  # gc may have won the race before our lease
            raise CheckpointError(f"{run}@{step} was removed (by `ckpt gc`?) before it could be read. "
                                  f"Fix: resume from a checkpoint that exists: {home.committed_steps(run) or 'none'}")
        yield lease
    finally:
        release(home, lease)


def _home(store, ref):
    """(the store holding ref's checkpoint, its run, its step), or Nones when it is in no catalog."""
    if ref.run is not None and ref.step is not None:
        return store, ref.run, ref.step
    parts = ref.url.rstrip("/").rsplit("/", 3)
    if len(parts) != 4 or parts[2] != "checkpoints" or not STEP_DIR.match(parts[3]) or not parts[1]:
        return None, None, None
    # resolve() found the manifest, so the step is committed in that catalog; `reading` checks
    # again once the lease is taken. At the file-system root the store is "/".
    return store.at(parts[0] or "/"), parts[1], int(STEP_DIR.match(parts[3]).group(1))
