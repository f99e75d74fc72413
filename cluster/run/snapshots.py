"""Snapshots in the nodes' memory: taken every `--snapshot-every` steps, resumed from on a restart.

A snapshot is an ordinary checkpoint of the run, committed to the snapshot keepers' filesystem
(`rayshard-snapshot://`, actors/snapshot/) instead of the store: the same ranks' `save_shard`, the
same manifest, checksums and commit, two copies of every file on two nodes. So a recovery from
memory is the same resharded, verified load as a recovery from storage, from another URL, onto
whatever layout the elastic controller chose. Snapshots never touch the store: the durable LATEST
moves only with `--ckpt-every` checkpoints.

On a restart the newest snapshot is used only if it is newer than the durable LATEST and every
file its manifest names is still held whole by a live keeper; otherwise the whole recovery reads
the durable checkpoint, and one line says why. Never a mix of two steps.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from dataclasses import dataclass

from rayshard.actors.snapshot.filesystem import SnapshotKeeperLost
from rayshard.actors.snapshot.keepers import start_keepers
from rayshard.cluster.catalog.snapshot_record import RECORD_EVERY_S, write_snapshot_record
from rayshard.cluster.catalog.store import STEP_DIR, CheckpointRef, Store
from rayshard.cluster.run.async_save import AsyncCheckpointer
from rayshard.plans.layout.snapshot_memory import SNAPSHOTS_IN_FLIGHT  # one per rank staging buffer
from rayshard.plans.errors import CheckpointError
from rayshard.storage.manifest_io import read_manifest


def snapshot_store_url(store_url: str) -> str:
    """Where a store's runs keep their snapshots: one root per durable store, so two jobs that
    share a Ray namespace but not a store never see each other's snapshots."""
    return f"rayshard-snapshot://{hashlib.sha256(store_url.encode()).hexdigest()[:16]}"


@dataclass(frozen=True)
class SnapshotChoice:
    """What a restart resumes from, as far as snapshots go: the snapshot (None: use the durable
    checkpoint) and the line that says why."""

    ref: CheckpointRef | None
    why: str


# How long the end of an attempt may spend committing a snapshot whose writes had all ended (two
# small conditional writes to the keepers; each keeper call has its own bound besides).
SETTLE_COMMIT_BOUND_S = 10.0

# The newest snapshot this driver process committed, per (snapshot store, run): a restart that
# finds it gone says so, rather than silently resuming from storage.
_TAKEN: dict[tuple[str, str], int] = {}
# ... and what the metrics said of it (step, wall time taken, seconds it blocked), so the attempt
# that resumes from it names it until it takes a newer one.
_LATEST: dict[tuple[str, str], tuple[int, float, float]] = {}


class Snapshots:
    """A run's snapshots on the driver: start the keepers, take one when due, keep only the newest."""

    def __init__(self, store_url: str, run: str, every: int, durable: Store | None = None):
        self.run, self.every, self.durable = run, every, durable
        self._recorded_at = 0.0
        start_keepers()  # idempotent: a node added since the last attempt gets its keeper here
        self.store = Store(snapshot_store_url(store_url))
        self.latest: tuple[int, float, float] | None = None  # (step, wall time taken, seconds it blocked)
        self.background: AsyncCheckpointer | None = None  # `in_background`: the ranks' async save path
        # step -> the driver's time on snapshots after that step (its poll and its start): with the
        # ranks' optimizer wait for the snapshot's copy, the time training was held for it
        self.blocked_s: dict[int, float] = {}
        self.write_s: float | None = None  # the newest background snapshot's slowest write to the keepers
        self.run_lost = False  # `settle(lost_run=True)`: another trainer holds the run; write nothing more

    def in_background(self, group, world_size: int, metadata_for) -> None:
        """Take snapshots as async saves are taken: ranks copy to host memory (training waits only
        for that) and write to the keepers in a background thread; the driver commits once all are
        done, at a later step. Only while durable checkpoints are synchronous: a rank has one
        background save at a time. Two snapshots may be uncommitted (each rank stages into a second
        buffer while the first still uploads, docs/decisions.md 163); they commit in step order."""
        self.background = AsyncCheckpointer(group, self.store, self.run, world_size, metadata_for, self._committed,
                                            in_flight=SNAPSHOTS_IN_FLIGHT)

    def _committed(self, step: int, url: str) -> None:
        statuses = self.background.last_statuses
        waits = [s.optimizer_wait_seconds for s in statuses]
        # The slowest rank's write to the keepers: longer than a step, and the snapshot a failure
        # finds is one step older (decision 163).
        self.write_s = max((s.upload_seconds or 0.0 for s in statuses), default=None)
        self.taken(step, self.blocked_s.pop(step, 0.0) + max(waits, default=0.0))

    def start(self, step: int, parent: str | None) -> None:
        """Start the background snapshot of `step` (waits only while two are still uncommitted)."""
        started = time.perf_counter()
        try:
            self.background.start(step, parent)
        finally:
            self.blocked_s[step] = self.blocked_s.get(step, 0.0) + time.perf_counter() - started

    def poll(self, step: int | None = None) -> None:
        """After each step (`step`, the one just done): commit a finished background snapshot. A
        failed one is skipped with one line (the last checkpoint still covers a failure). The time
        spent here holds training too: it counts to the blocked time of `step`'s snapshot."""
        if self.background is None:
            return
        started = time.perf_counter()
        try:
            self.background.poll()
        except CheckpointError as error:
            print(f"snapshot not taken: {_first_line(error)}; training goes on", flush=True)
        finally:
            if step is not None:
                self.blocked_s[step] = self.blocked_s.get(step, 0.0) + time.perf_counter() - started
            for old in [s for s in self.blocked_s if step is not None and s < step - 4 * SNAPSHOTS_IN_FLIGHT]:
                del self.blocked_s[old]  # steps with no snapshot (K > 1), or whose snapshot failed

    def settle(self, lost_run: bool = False) -> None:
        """The attempt is ending (finished, or a rank failed): a snapshot commit already running
        on the driver ends first (bounded); then the newest snapshot whose every rank's write had
        already ended is committed (bounded); one still being written by the ranks is abandoned,
        never waited for: after a failure its ranks may be gone, and the run's last step has its
        durable checkpoint anyway. lost_run: this trainer lost the run's writer lease to another,
        which may be taking its own snapshots of the run: nothing more is committed, and no note
        goes to the durable store."""
        self.run_lost = self.run_lost or lost_run
        if self.background is not None:
            with contextlib.suppress(Exception):
                self.background.settle()
            # A commit that ended here was never reported (that happens at the next step's poll):
            # remember its step, so a restart that finds it gone names it, not an older one.
            committing = self.background.committing
            if committing is not None and not committing.thread.is_alive() and "url" in committing.outcome:
                key = (self.store.url, self.run)
                _TAKEN[key] = max(_TAKEN.get(key, 0), committing.save.step)
            # A snapshot whose every write had ended before the failure is whole: commit it now
            # rather than at a poll that never comes (decision 207).
            if self.run_lost:
                return
            with contextlib.suppress(Exception):
                step = self.background.commit_newest_finished(SETTLE_COMMIT_BOUND_S)
                if step is not None:
                    print(f"snapshot of step {step} committed as the attempt ended: every rank's write of it "
                          "had finished", flush=True)

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def taken(self, step: int, blocked_s: float) -> None:
        """Record a committed snapshot and drop every older one (each is a whole state in memory)."""
        self.latest = _LATEST[(self.store.url, self.run)] = (step, time.time(), blocked_s)
        _TAKEN[(self.store.url, self.run)] = step
        if self.durable is not None and not self.run_lost and time.time() - self._recorded_at >= RECORD_EVERY_S:
            self._recorded_at = time.time()
            try:  # a note for people (`ckpt ls`); training never waits on it failing
                write_snapshot_record(self.durable, self.run, step, self._recorded_at, self.keeper_nodes())
            except OSError as error:
                print(f"rayshard: warning: could not note snapshot step {step} in the store ({_first_line(error)})",
                      flush=True)
        for older in self._step_dirs():
            if older < step:  # committed, or abandoned by a failed attempt: either way memory held
                self.store.fs.rm(f"{self.store.root}/{self.run}/checkpoints/step-{older:08d}", recursive=True)

    def resumed_from(self, step: int) -> None:
        """The run resumes from the snapshot of `step`: it stays in memory (and in the metrics)
        until a newer one is committed."""
        known = _LATEST.get((self.store.url, self.run))
        self.latest = known if known is not None and known[0] == step else (step, time.time(), 0.0)

    def forget_after(self, step: int) -> None:
        """A resume at `step` redoes the steps after it: their snapshots (from the failed attempt)
        would collide with the new ones' create-only commits."""
        for newer in self._step_dirs():
            if newer > step:
                self.store.fs.rm(f"{self.store.root}/{self.run}/checkpoints/step-{newer:08d}", recursive=True)

    def _step_dirs(self) -> list[int]:
        """The steps with a directory in the keepers, committed or not (a failed attempt leaves
        the writes it never committed: they hold memory until dropped here)."""
        base = f"{self.store.root}/{self.run}/checkpoints"
        try:
            names = [path.rstrip("/").rsplit("/", 1)[-1] for path in self.store.fs.ls(base, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(int(match.group(1)) for match in map(STEP_DIR.match, names) if match)

    def choose(self, durable_step: int | None) -> SnapshotChoice:
        """The newest snapshot if it is newer than the durable checkpoint and whole."""
        steps = self.store.committed_steps(self.run)
        taken = _TAKEN.get((self.store.url, self.run))
        if not steps:
            return SnapshotChoice(None, "no snapshot in memory" if taken is None else
                                  f"the snapshot of step {taken} was lost with its keepers (no copy survives)")
        step = steps[-1]
        if durable_step is not None and step <= durable_step:
            return SnapshotChoice(None, f"the snapshot (step {step}) is not newer than the checkpoint (step {durable_step})")
        ref = CheckpointRef(self.store.checkpoint_url(self.run, step), self.run, step)
        try:
            chunks, _ = read_manifest(ref.url)
        except (OSError, CheckpointError) as error:
            return SnapshotChoice(None, f"the snapshot of step {step} lost its manifest ({_first_line(error)})")
        directory = f"{self.store.root}/{self.run}/checkpoints/step-{step:08d}"
        sizes = {path[len(directory) + 1:]: info["size"]
                 for path, info in self.store.fs.find(directory, detail=True).items()}
        for file, extent in chunks.file_extents().items():
            if sizes.get(file, -1) < extent:
                return SnapshotChoice(None, f"the snapshot of step {step} has no surviving copy of {file}")
        return SnapshotChoice(ref, f"the snapshot of step {step} is whole in memory")

    def describe(self) -> dict:
        """For the metrics: the snapshot's step, age and the nodes keeping it."""
        if self.latest is None:
            return {}
        step, at, blocked_s = self.latest
        return {"snapshot_step": step, "snapshot_age_s": round(time.time() - at, 3),
                "snapshot_blocked_s": round(blocked_s, 4),
                **({"snapshot_write_s": round(self.write_s, 4)} if self.write_s is not None else {}),
                "snapshot_nodes": sorted(n[:12] for n in self.keeper_nodes())}

    def keeper_nodes(self) -> list[str]:
        return list(self.store.fs.keepers())


def snapshot_failure(error: BaseException) -> str | None:
    """Why a snapshot failed when the failure is the snapshot's own (a keeper lost, a write
    refused), else None: a rank that died saving is the attempt's failure, not the snapshot's."""
    cause = getattr(error, "cause", None) or error
    if isinstance(cause, (SnapshotKeeperLost, CheckpointError)):
        return _first_line(cause)
    return None


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
