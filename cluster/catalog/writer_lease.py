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
import sys
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


def _pid_namespace() -> str:
    """Containers on one host network share a host name but not their process ids."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _this_holder() -> dict:
    job = os.environ.get("RAY_JOB_SUBMISSION_ID")
    host, pid = socket.gethostname(), os.getpid()
    return {"holder": (f"job {job} " if job else "") + f"pid {pid} on {host}", "host": host, "pid": pid,
            "pid_namespace": _pid_namespace()}


def _process_gone(record: dict) -> bool:
    """The holder ran on this host, in this process namespace, and its process no longer exists."""
    if (record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int)
            or record.get("pid_namespace", "") != _pid_namespace()):
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

    def acquire(self, attempts: int = 5, wait_s: float = 0.0) -> None:
        """Take the lease, or raise RunBusy naming its live holder. A holder that has stopped
        renewing (missed two renewals: killed on another host) is waited out, at most until its
        lease lapses, saying so, rather than refused: a resubmit must not fail for a dead trainer.
        wait_s: how long a holder that still looks alive is waited for before RunBusy (0 for a
        trainer, which should hear at once; a library restarted by its own launcher on another
        host finds its dead predecessor's lease looking alive for up to two renewal periods)."""
        backend = self.store.backend
        backend.make_directory(self.path.rsplit("/", 1)[0])
        tries, deadline, said = 0, time.time() + wait_s, False
        while tries < attempts:
            data, version = backend.read_versioned(self.path)
            record = _parse(data)
            if data is not None and not self._takeable(record):
                elsewhere = (record.get("host") != socket.gethostname()
                             or record.get("pid_namespace", "") != _pid_namespace())  # here, alive is known
                if elsewhere and time.time() < deadline and not self._wait_if_lapsing(record):
                    if not said:
                        print(f"rayshard: run {self.run!r}: its writer lease is held by "
                              f"{record.get('holder', 'another process')}; waiting up to {wait_s:.0f} s for it to be "
                              "released or to lapse", file=sys.stderr, flush=True)
                        said = True
                    time.sleep(min(self.ttl_s / 8, max(0.0, deadline - time.time())) or 0.1)
                    continue
                if not self._wait_if_lapsing(record):
                    left = record["expires_unix"] - time.time()
                    raise RunBusy(
                        f"run {self.run!r} is being trained by {record.get('holder', 'another process')} (its writer "
                        f"lease {self.store.backend.url(self.path)} runs {left:.0f} s more unless renewed): one trainer "
                        "per run. Fix: wait for that trainer to finish or stop it (a dead one's lease lapses by "
                        "itself), or train under another --run name")
                continue  # waited for it to lapse: look again
            tries += 1
            try:
                backend.replace_if(self.path, self._record(time.time() + self.ttl_s), version)
            except PreconditionFailed:
                continue  # another trainer moved it between our read and our write: look again
            if self._note_version():
                return
        raise RunBusy(f"run {self.run!r}: its writer lease kept changing while this trainer tried to take it "
                      f"({attempts} tries): another trainer is starting on it. Fix: run one trainer per run")

    def _wait_if_lapsing(self, record: dict) -> bool:
        """Sleep until a lease whose holder stopped renewing lapses; False when it is renewed on time."""
        renewed, expires = record.get("renewed_unix"), record["expires_unix"]
        if not isinstance(renewed, (int, float)) or expires <= renewed:
            return False
        now, period = time.time(), (expires - renewed) / 4
        if now - renewed <= 2 * period:
            return False
        wait = min(expires - now, expires - renewed) + 1.0
        print(f"rayshard: run {self.run!r}: its writer lease, held by {record.get('holder', 'another process')}, has not "
              f"been renewed for {now - renewed:.0f} s (a trainer that died?); waiting {wait:.0f} s for it to lapse",
              file=sys.stderr, flush=True)
        time.sleep(max(0.0, wait))
        return True

    def _takeable(self, record: dict) -> bool:
        if record.get("token") == self.token:
            return True
        same_process = record.get("host") == socket.gethostname() and record.get("pid") == os.getpid()
        return same_process or record["expires_unix"] <= time.time() or _process_gone(record)

    def renew(self) -> None:
        """Extend the lease; a lease someone else took since is lost, and says to whom. A write
        of ours whose version was not read back (a network error in between) is recognised by
        its token and renewed from the version it has now."""
        for _ in range(2):
            try:
                self.store.backend.replace_if(self.path, self._record(time.time() + self.ttl_s), self.version)
                break
            except PreconditionFailed:
                data, version = self.store.backend.read_versioned(self.path)
                record = _parse(data)
                if record.get("token") != self.token:
                    self.lost = f"{record.get('holder', 'another process')} took the run's writer lease"
                    return
                self.version = version  # still ours: renew from the version it holds now
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
