"""One writer per run: a lease object that a trainer takes before its first step and renews while
it trains, so a second trainer on the same run is refused at once, naming the holder, instead of
training for nothing until its first clashing commit.

    {store}/{run}/WRITER      {"holder": ..., "host": ..., "pid": ..., "expires_unix": ..., ...}

Object stores have no locks, so the lease is taken and renewed with the backend's
compare-and-swap (the one LATEST moves with): of two trainers that read the same state, exactly
one write succeeds. A lease expires `ttl_s` after its last renewal, so a writer killed with -9
blocks nobody for longer than that; a writer on this same host whose process is gone is known
dead at once (a resubmitted job on the head node does not wait out the expiry). The commit's
create-only manifest and LATEST swap stay the guarantee; the lease is what makes a second
writer fail before it spends a step.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

from rayshard.storage.backends.protocol import PreconditionFailed
from rayshard.cluster.catalog.store import Store
from rayshard.plans.errors import CheckpointError

DEFAULT_TTL_S = 120.0
LEASE_NAME = "WRITER"


class RunBusy(CheckpointError):
    """Another live trainer holds the run's writer lease."""


def _this_holder() -> dict:
    job = os.environ.get("RAY_JOB_SUBMISSION_ID")
    host, pid = socket.gethostname(), os.getpid()
    return {"holder": (f"job {job} " if job else "") + f"pid {pid} on {host}", "host": host, "pid": pid}


def _process_gone(record: dict) -> bool:
    """The holder ran on this host and its process no longer exists."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return False
    try:
        os.kill(record["pid"], 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


@dataclass
class WriterLease:
    store: Store
    run: str
    ttl_s: float
    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    version: str | None = None
    lost: str | None = None  # why the lease is no longer ours, once it is not
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def path(self) -> str:
        return f"{self.store.root}/{self.run}/{LEASE_NAME}"

    def _record(self, expires: float) -> bytes:
        return json.dumps({**_this_holder(), "token": self.token, "expires_unix": expires,
                           "renewed_unix": time.time()}, sort_keys=True).encode()

    def acquire(self, attempts: int = 5) -> None:
        backend = self.store.backend
        backend.make_directory(self.path.rsplit("/", 1)[0])
        for _ in range(attempts):
            data, version = backend.read_versioned(self.path)
            record = _parse(data)
            if data is not None and not self._takeable(record):
                left = record["expires_unix"] - time.time()
                raise RunBusy(
                    f"run {self.run!r} is being trained by {record.get('holder', 'another process')} (its writer lease "
                    f"{self.store.backend.url(self.path)} runs {left:.0f} s more unless renewed): one trainer per run. "
                    "Fix: wait for that trainer to finish or stop it (a dead one's lease lapses by itself), "
                    "or train under another --run name")
            try:
                backend.replace_if(self.path, self._record(time.time() + self.ttl_s), version)
            except PreconditionFailed:
                continue  # another trainer moved it between our read and our write: look again
            if self._note_version():
                return
        raise RunBusy(f"run {self.run!r}: its writer lease kept changing while this trainer tried to take it "
                      f"({attempts} tries): another trainer is starting on it. Fix: run one trainer per run")

    def _takeable(self, record: dict) -> bool:
        if record.get("token") == self.token:
            return True
        same_process = record.get("host") == socket.gethostname() and record.get("pid") == os.getpid()
        return same_process or record["expires_unix"] <= time.time() or _process_gone(record)

    def renew(self) -> None:
        """Extend the lease; a lease someone else took since is lost, and says to whom."""
        try:
            self.store.backend.replace_if(self.path, self._record(time.time() + self.ttl_s), self.version)
        except PreconditionFailed:
            holder = _parse(self.store.backend.read_versioned(self.path)[0]).get("holder", "another process")
            self.lost = f"{holder} took the run's writer lease"
            return
        if not self._note_version():
            self.lost = "another trainer took the run's writer lease"

    def _note_version(self) -> bool:
        """Remember the version just written (backends do not return it from the write); False
        when the object read back is no longer ours."""
        data, version = self.store.backend.read_versioned(self.path)
        if _parse(data).get("token") != self.token:
            return False
        self.version = version
        return True

    def start_renewing(self) -> None:
        def renew_until_stopped():
            deadline = time.time() + self.ttl_s
            while not self._stop.wait(self.ttl_s / 4) and self.lost is None:
                try:
                    self.renew()
                    deadline = time.time() + self.ttl_s
                except Exception as error:  # a store hiccup: try again next period, until the lease lapses
                    if time.time() >= deadline:
                        self.lost = f"renewals failed for {self.ttl_s:.0f} s ({type(error).__name__})"

        self._thread = threading.Thread(target=renew_until_stopped, name=f"writer-lease-{self.run}", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise if the lease is no longer this trainer's: it must not commit for a run it lost."""
        if self.lost is not None:
            raise RunBusy(f"run {self.run!r}: this trainer lost its writer lease ({self.lost}); it stops before "
                          "committing anything more. Fix: let the other trainer finish, or resume this run later "
                          "with --resume latest")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lost is None:
            with contextlib.suppress(PreconditionFailed, OSError):
                released = json.dumps({**_this_holder(), "token": self.token, "expires_unix": 0,
                                       "released_unix": time.time()}, sort_keys=True).encode()
                self.store.backend.replace_if(self.path, released, self.version)


def _parse(data: bytes | None) -> dict:
    """A lease record; unreadable (damaged, or an older file) counts as expired."""
    try:
        record = json.loads(data) if data else {}
    except ValueError:
        record = {}
    if not isinstance(record, dict) or not isinstance(record.get("expires_unix"), (int, float)):
        return {"expires_unix": 0.0}
    return record


@contextlib.contextmanager
def holding(store: Store, run: str, ttl_s: float = DEFAULT_TTL_S):
    """The run's writer lease for the duration of the block, renewed in the background."""
    lease = WriterLease(store, run, ttl_s)
    lease.acquire()
    lease.start_renewing()
    try:
        yield lease
    finally:
        lease.release()
