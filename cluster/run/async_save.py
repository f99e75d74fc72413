"""The driver's side of asynchronous saves.

`start` requests a save and returns at once: each rank copies its share of the state to host
memory in a background thread, overlapping the next forward and backward (its next optimizer
step waits for the copy if it is not done yet), then uploads it. After each training step the
driver `poll`s: once every rank's upload has finished, the manifest is committed (create-only,
then LATEST moves) in a driver thread and reported at a later poll; when an upload failed, the
failure is raised there — at the next steps — as a CheckpointError naming the rank and the
object; nothing was committed, so LATEST still names the last good checkpoint. The next save
first waits for the previous one, so at most one save is in flight.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import ray

from plans.checkpoint.manifest import encode_manifest
from cluster.storage.store import Store
from plans.checkpoint.chunks import Chunk
from plans.errors import CheckpointError
from plans.checkpoint.reshard import check_chunks_disjoint_and_complete


@dataclass
class PendingSave:
    step: int
    url: str
    parent: str | None
    requests: list  # ObjectRefs of the ranks' stage_save calls
    status_requests: list | None = None  # ObjectRefs of save_status calls not looked at yet


class AsyncCheckpointer:
    """Nothing here waits on the ranks while training runs: Ray runs one caller's calls to an
    actor in the order they were sent, so `stage_save` is sent without waiting (it runs before
    the rank's next train_step), and `poll` sends `save_status` and reads the answer at the next
    poll. The ranks themselves make their next optimizer step wait for the snapshot copy."""

    def __init__(self, group, store: Store, run: str, world_size: int,
                 metadata_for: Callable[[int, str | None], dict], on_commit: Callable[[int, str], None]):
        self.group, self.store, self.run, self.world_size = group, store, run, world_size
        self.metadata_for, self.on_commit = metadata_for, on_commit
        self.pending: PendingSave | None = None  # requested, copying or uploading
        self.committing: tuple | None = None  # (PendingSave, thread, outcome): manifest and LATEST being written
        self.last_statuses: list[dict] = []

    def start(self, step: int, parent: str | None) -> str:
        """Request a save of `step`; returns the URL it will commit to. Waits only for the
        previous save, if it is still in flight."""
        self.wait()
        attempt = self.store.new_attempt()
        url = self.store.checkpoint_url(self.run, step)
        files = [f"{attempt}/rank-{rank:05d}.safetensors" for rank in range(self.world_size)]
        requests = [actor.stage_save.remote(url, file) for actor, file in zip(self.group.actors, files)]
        self.pending = PendingSave(step, url, parent, requests)
        return url

    def poll(self) -> None:
        """Called after each training step: report a finished commit; once every rank's upload
        has finished, start committing in a driver thread (training goes on meanwhile); raise
        if an upload or a commit failed."""
        self._finish_commit(block=False)
        pending = self.pending
        if pending is None:
            return
        if pending.status_requests is None:
            pending.status_requests = [actor.save_status.remote(False) for actor in self.group.actors]
            return
        ready, _ = ray.wait(pending.status_requests, num_returns=len(pending.status_requests), timeout=0)
        if len(ready) < len(pending.status_requests):
            return
        ray.get(pending.requests)  # a rank that could not even start the save raises here
        statuses, pending.status_requests = ray.get(ready), None
        if any(s["error"] for s in statuses) or all(s["done"] for s in statuses):
            if not all(s["done"] for s in statuses):  # report only once every rank has stopped writing
                statuses = self.group.call("save_status", True)
            self._begin_commit(statuses)

    def wait(self) -> None:
        """Block until the pending save is committed (or raise its failure)."""
        if self.pending is not None:
            ray.get(self.pending.requests)
            self._begin_commit(self.group.call("save_status", True))
        self._finish_commit(block=True)

    def _begin_commit(self, statuses: list[dict]) -> None:
        pending, self.pending = self.pending, None
        self.last_statuses = statuses  # per rank: copy, upload and optimizer-wait seconds (bench/storage.py)
        errors = [s["error"] for s in statuses if s["error"]]
        if errors:
            latest = self.store.latest_step(self.run)
            kept = (f"LATEST still names step {latest}, the last good checkpoint" if latest is not None
                    else "the run has no committed checkpoint yet")
            raise CheckpointError(
                f"checkpoint step {pending.step} of run {self.run!r} was not committed: its background upload "
                f"failed on {len(errors)} rank(s): " + "; ".join(errors) + f". {kept}; the partial upload is a "
                "leftover that `rayshard ckpt gc` removes. Fix: check the store (credentials, quota, network), "
                "then resume with --resume latest")
        chunks = [Chunk.from_row(row) for status in statuses for row in status["rows"]]
        check_chunks_disjoint_and_complete(chunks)
        manifest = encode_manifest(chunks, self.metadata_for(pending.step, pending.parent))
        outcome: dict = {}

        def commit() -> None:
            try:
                outcome["url"] = self.store.commit(self.run, pending.step, manifest)
            except BaseException as error:  # re-raised on the training thread by _finish_commit
                outcome["error"] = error

        thread = threading.Thread(target=commit, name=f"commit-step-{pending.step}", daemon=True)
        thread.start()
        self.committing = (pending, thread, outcome)

    def _finish_commit(self, block: bool) -> None:
        """On the training thread: surface a commit's outcome (on_commit, or its error)."""
        if self.committing is None:
            return
        pending, thread, outcome = self.committing
        if block:
            thread.join()
        elif thread.is_alive():
            return
        self.committing = None
        if "error" in outcome:
            raise outcome["error"]
        self.on_commit(pending.step, outcome["url"])
