"""The driver's side of asynchronous saves.

`start` requests a save and returns at once: each rank copies its share of the state to host
memory in a background thread, overlapping the next forward and backward (its next optimizer
step waits for the copy if it is not done yet), then uploads it. After each training step the
driver `poll`s: once every rank's upload has finished (each rank answers a `save_finished`
call the moment it does), the manifest is committed (create-only, then LATEST moves) in a driver
thread and reported at a later poll; when an upload failed, the
failure is raised there — at the next steps — as a CheckpointError naming the rank and the
object; nothing was committed, so LATEST still names the last good checkpoint. At most
`in_flight` saves are uncommitted: the next one waits for the oldest; they commit in step order.
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import ray

from rayshard.cluster.catalog.pending import PendingCheckpoint
from rayshard.cluster.catalog.store import Store
from rayshard.plans.checkpoint.chunk_table import ChunkTable, as_table
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.errors import CheckpointError


@dataclass(frozen=True)
class SaveStatus:
    """One rank's answer to `save_status`, as the driver reads it."""
    done: bool
    chunks: ChunkTable | None  # what the rank wrote (its manifest rows as columns), once done without error
    error: str | None  # the failed upload, naming the rank and the object
    copy_seconds: float | None
    upload_seconds: float | None
    optimizer_wait_seconds: float

    @classmethod
    def from_reply(cls, reply: dict) -> "SaveStatus":
        rows = reply["rows"]
        if rows is not None and not isinstance(rows, ChunkTable):  # a list of row dicts
            rows = as_table([Chunk.from_row(row) for row in rows])
        return cls(reply["done"], rows, reply["error"],
                   reply["copy_seconds"], reply["upload_seconds"], reply["optimizer_wait_seconds"])


# How long a rank's upload may take before the driver stops waiting for it and names the rank.
UPLOAD_BOUND_S = 600.0


@dataclass
class PendingSave:
    step: int
    checkpoint: PendingCheckpoint
    parent: str | None
    requests: list  # ObjectRefs of the ranks' stage_save calls
    finished: list  # ObjectRefs of the ranks' save_finished calls: ready once each rank's upload ended


@dataclass(frozen=True)
class Committing:
    """A save whose manifest and LATEST are being written on a driver thread."""
    save: PendingSave
    thread: threading.Thread
    outcome: dict  # "url" or "error", set by the thread


class AsyncCheckpointer:
    """Nothing here waits on the ranks while training runs: Ray runs one caller's calls to an
    actor in the order they were sent, so `stage_save` is sent without waiting (it runs before
    the rank's next train_step), and with it `save_finished`, which runs on the rank's own
    save-waits thread and answers as soon as that rank's upload ends; `poll` only looks whether
    every rank answered. The ranks themselves make their next optimizer step wait for the copy.

    in_flight: saves requested and not yet committed (each rank has two staging buffers,
    actors/checkpoint/async_save.py). 1: a save starts once the previous one is committed. 2
    (snapshots): a save's staging overlaps the previous one's upload; they commit in step order."""

    def __init__(self, group, store: Store, run: str, world_size: int,
                 metadata_for: Callable[[int, str | None], dict], on_commit: Callable[[int, str], None],
                 in_flight: int = 1):
        self.group, self.store, self.run, self.world_size = group, store, run, world_size
        self.metadata_for, self.on_commit, self.in_flight = metadata_for, on_commit, in_flight
        self.pending: deque[PendingSave] = deque()  # requested, copying or uploading; oldest first
        self.committing: Committing | None = None
        self.last_statuses: list[SaveStatus] = []

    def start(self, step: int, parent: str | None) -> str:
        """Request a save of `step`; returns the URL it will commit to. Waits only while
        `in_flight` saves are still uncommitted (for the oldest)."""
        while len(self.pending) >= self.in_flight:
            self._wait_oldest()
        checkpoint = self.store.begin(self.run, step)
        actors = list(zip(range(self.world_size), self.group.actors))
        requests = [actor.stage_save.remote(checkpoint.url, checkpoint.file_for(rank)) for rank, actor in actors]
        finished = [actor.save_finished.remote(checkpoint.url, UPLOAD_BOUND_S) for _, actor in actors]
        self.pending.append(PendingSave(step, checkpoint, parent, requests, finished))
        return checkpoint.url

    def poll(self) -> None:
        """Called after each training step: report a finished commit; once every rank's upload of
        the oldest save has ended, start committing it in a driver thread (training goes on
        meanwhile); raise if an upload or a commit failed."""
        self._finish_commit(block=False)
        if not self.pending or self.committing is not None:
            return
        oldest = self.pending[0]
        refs = oldest.requests + oldest.finished
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        started = set(ready) & set(oldest.requests)
        if started:
            ray.get(list(started))  # a rank that could not even start the save raises here
        if len(ready) == len(refs):
            self._begin_commit(self._statuses(ray.get(oldest.finished)))

    def wait(self) -> None:
        """Block until every pending save is committed (or raise the first failure)."""
        while self.pending:
            self._wait_oldest()
        self._finish_commit(block=True)

    def _wait_oldest(self) -> None:
        self._finish_commit(block=True)
        oldest = self.pending[0]
        # Bounded like every rank call (RankGroup.call_timeout_s); the staging copy is short.
        ray.get(oldest.requests, timeout=getattr(self.group, "call_timeout_s", None))
        ready, _ = ray.wait(oldest.finished, num_returns=len(oldest.finished), timeout=UPLOAD_BOUND_S + 30)
        replies = [ray.get(ref) if ref in ready else None for ref in oldest.finished]
        self._begin_commit(self._statuses(replies))
        self._finish_commit(block=True)

    def _statuses(self, replies: list[dict | None]) -> list[SaveStatus]:
        """Each rank's reply; a rank that did not answer, or whose upload did not end, within
        UPLOAD_BOUND_S is a failed upload that names it."""
        step = self.pending[0].step
        return [SaveStatus.from_reply(reply) if reply is not None and reply["done"] else
                SaveStatus(True, None, f"rank {rank}: its upload of step {step} did not end within {UPLOAD_BOUND_S:.0f} s "
                                       "(treated as lost)", None, None, 0.0)
                for rank, reply in enumerate(replies)]

    def _begin_commit(self, statuses: list[SaveStatus]) -> None:
        pending = self.pending.popleft()
        self.last_statuses = statuses  # per rank: copy, upload and optimizer-wait seconds (bench/storage.py)
        errors = [s.error for s in statuses if s.error]
        if errors:
            latest = self.store.latest_step(self.run)
            kept = (f"LATEST still names step {latest}, the last good checkpoint" if latest is not None
                    else "the run has no committed checkpoint yet")
            raise CheckpointError(
                f"checkpoint step {pending.step} of run {self.run!r} was not committed: its background upload "
                f"failed on {len(errors)} rank(s): " + "; ".join(errors) + f". {kept}; the partial upload is a "
                "leftover that `rayshard ckpt gc` removes. Fix: check the store (credentials, quota, network), "
                "then resume with --resume latest")
        # Checked and encoded here, on the training thread, so a bad save is reported at once;
        # only the two conditional writes run on the commit thread.
        # Columns concatenated, not a record per chunk: 16k ranks' tables gather, check and encode in ~1.7 s.
        chunks = ChunkTable.concat([status.chunks for status in statuses])
        manifest = pending.checkpoint.manifest(chunks, self.metadata_for(pending.step, pending.parent))
        self.committing = _committing(pending, manifest, chunks)

    def commit_newest_finished(self, timeout_s: float) -> int | None:
        """After a failure: commit the newest requested save whose every rank had already ended
        its upload without an error, and drop the older ones, instead of abandoning it with the
        attempt (a snapshot's commit otherwise waits for the next step's `poll`, which a failure
        never reaches: with writes longer than a step that cost a second redone step, decision
        207). Nothing the ranks still do is waited for, and a rank that died is asked nothing:
        its answer is one it gave before it died or none. Its step, or None."""
        if self.committing is not None:
            if self.committing.thread.is_alive():
                return None  # never two commits at once; `settle` has waited its bound for this one
            with contextlib.suppress(Exception):  # its outcome first (an error leaves the older one standing)
                self._finish_commit(block=False)
        for save in reversed(self.pending):
            statuses = _finished_statuses(save.finished)
            if statuses is None:
                continue
            try:
                chunks = ChunkTable.concat([status.chunks for status in statuses])
                manifest = save.checkpoint.manifest(chunks, self.metadata_for(save.step, save.parent))
            except Exception:  # noqa: BLE001 - not a whole checkpoint: an older one may be
                continue
            committing = _committing(save, manifest, chunks)
            committing.thread.join(timeout_s)
            if "url" not in committing.outcome:
                return None  # failed or still running: what was committed before stands
            self.pending.clear()  # older ones are superseded, newer ones were not whole
            self.last_statuses = statuses
            self.on_commit(save.step, committing.outcome["url"])
            return save.step
        return None

    def settle(self, timeout_s: float = 60.0) -> None:
        """Before the run lets go of its writer lease (a step failed): a commit in flight on the
        driver thread ends first, bounded, so the run's next trainer never races its two writes."""
        if self.committing is not None:
            self.committing.thread.join(timeout_s)

    def _finish_commit(self, block: bool) -> None:
        """On the training thread: surface a commit's outcome (on_commit, or its error)."""
        if self.committing is None:
            return
        committing = self.committing
        if block:
            committing.thread.join()
        elif committing.thread.is_alive():
            return
        self.committing = None
        if "error" in committing.outcome:
            raise committing.outcome["error"]
        self.on_commit(committing.save.step, committing.outcome["url"])


def _finished_statuses(finished: list) -> list[SaveStatus] | None:
    """Every rank's status of one save if each had already answered that its upload ended
    without an error (answers a dead rank gave before it died are kept by its caller), else None."""
    ready, _ = ray.wait(finished, num_returns=len(finished), timeout=0)
    if len(ready) < len(finished):
        return None
    try:
        replies = ray.get(finished, timeout=5.0)
    except Exception:  # noqa: BLE001 - an answer lost with its node: the save is not whole
        return None
    statuses = [SaveStatus.from_reply(reply) for reply in replies if reply is not None]
    if len(statuses) < len(finished) or not all(s.done and s.error is None and s.chunks is not None for s in statuses):
        return None
    return statuses


def _committing(save: PendingSave, manifest: bytes, chunks: ChunkTable) -> Committing:
    """Start writing save's manifest and LATEST on a driver thread, once its files are listed
    there whole (off the training thread: a listing of the store); its outcome ("url" or
    "error") is read by whoever waits for the thread."""
    outcome: dict = {}

    def commit() -> None:
        try:
            save.checkpoint.check_files_written(chunks)
            outcome["url"] = save.checkpoint.commit_manifest(manifest)
        except BaseException as error:  # noqa: BLE001 - re-raised (or, after a failure, dropped) by the reader
            outcome["error"] = error

    thread = threading.Thread(target=commit, name=f"commit-step-{save.step}", daemon=True)
    thread.start()
    return Committing(save, thread, outcome)
