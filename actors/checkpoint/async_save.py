"""A rank's asynchronous save: a snapshot of the rank's share of the state is copied to host
memory while training goes on, then uploaded from that copy, all in a background thread.

Why training need not wait for the copy: between two optimizer steps nothing writes the
parameters or the AdamW moments (forward and backward only read them; gradients live elsewhere).
So the copy starts right after the save is requested and overlaps the next step's forward and
backward, and an optimizer step pre-hook makes the next `optimizer.step()` wait until the copy is
complete — the only point where training can be blocked, and only when the copy is slower than
a forward and backward. On a GPU the copy runs on a side stream into pinned buffers.

Memory: the rank's share of the checkpoint in host memory (what torch DCP's async save also
pays), twice when a save starts while the previous one still uploads, kept between saves so the next copy has no allocation or page faults, plus the streaming
writer's bounded part buffers. A save never starts while the previous one still reads the
buffers: the trainer's `AsyncSaver` owns both the buffers and the saves in flight. The driver polls `status`; a failed upload is returned as text naming the rank and the
object, never raised here, so the driver can report it at the next step.
"""
from __future__ import annotations

import threading
import time

import fsspec

from rayshard.actors.checkpoint.save import pieces_to_write
from rayshard.actors.checkpoint.shard_writer import Piece, write_shard
from rayshard.actors.checkpoint.staging import HostStaging
from rayshard.actors.parallel.shards import NO_PIPELINE_COPIES, PipelineCopies
from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.layout.snapshot_memory import STAGING_BUFFERS  # a save stages while the previous one uploads


class AsyncSaver:
    """A rank's asynchronous saves: owns the host buffers they copy into (reused across saves) and
    the saves still running. The trainer holds one for its lifetime.

    Two sets of buffers, so a save can stage while the previous one is still uploading from the
    other set (snapshots every step: docs/decisions.md 163). A set is reused only once the save
    that filled it has finished uploading, and a save prefers a free set it used before, so a rank
    whose uploads keep up with its saves only ever fills one set."""

    def __init__(self, buffers: int = STAGING_BUFFERS):
        self.stagings = [HostStaging() for _ in range(buffers)]  # (name, kind, offsets) -> host buffer
        self._saves: list[BackgroundSave | None] = [None] * buffers  # the last save of each set

    @property
    def staging(self) -> HostStaging:
        return self.stagings[0]

    def start(self, model, optimizer, checkpoint_url: str, file: str, rank: int,
              copies: PipelineCopies = NO_PIPELINE_COPIES, only: frozenset[str] | None = None) -> "BackgroundSave":
        """Begin a save of this rank's share of the state; return it (poll its `status`)."""
        for save in self._saves:
            if save is not None and save.hook is not None:
                save._copied.wait()  # (done by now: an optimizer step ran since, and it waited for the copy)
                save.hook.remove()  # (removed here, not inside the hook: step() is iterating hooks then)
                save.hook = None
        slot = next((i for i, save in enumerate(self._saves) if save is None or save._done.is_set()), None)
        if slot is None:  # both sets are still being uploaded from: the older one's upload ends first
            slot = min(range(len(self._saves)), key=lambda i: self._saves[i].started)
            self._saves[slot].status(wait=True)
        self._saves[slot] = BackgroundSave(self.stagings[slot], model, optimizer, checkpoint_url, file, rank, copies,
                                           only)
        return self._saves[slot]


class BackgroundSave:
    """One save: made by `AsyncSaver.start`."""

    def __init__(self, staging: HostStaging, model, optimizer, checkpoint_url: str, file: str, rank: int,
                 copies: PipelineCopies = NO_PIPELINE_COPIES, only: frozenset[str] | None = None):
        self.started = started = time.perf_counter()
        self.staging = staging
        self.where = f"rank {rank} ({checkpoint_url}/{file})"
        live = pieces_to_write(model, optimizer, copies, only)  # references to the live tensors, no bytes yet
        keys = [(piece.name, piece.kind, tuple(piece.offsets)) for piece in live]
        staging.keep_only(keys)
        self.rows: ChunkTable | None = None  # the manifest rows written, as columns
        self.error: str | None = None
        self.copy_seconds = self.upload_seconds = None
        self.optimizer_wait_seconds = 0.0
        self._copied, self._done = threading.Event(), threading.Event()
        self.hook = optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._thread = threading.Thread(target=self._run, args=(live, keys, checkpoint_url, file),
                                        name="checkpoint-save", daemon=True)
        self._thread.start()
        self.staged = {"bytes": sum(piece.tensor.numel() * piece.tensor.element_size() for piece in live),
                       "seconds": time.perf_counter() - started}

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        if not self._copied.is_set():
            started = time.perf_counter()
            self._copied.wait()  # the step would overwrite what is still being copied
            self.optimizer_wait_seconds += time.perf_counter() - started

    def _run(self, live, keys, checkpoint_url: str, file: str) -> None:
        try:
            started = time.perf_counter()
            try:
                pieces = self._copy(live, keys)
            finally:
                self.copy_seconds = time.perf_counter() - started
                self._copied.set()
            started = time.perf_counter()
            if pieces:
                fs, base = fsspec.core.url_to_fs(checkpoint_url)
                self.rows = ChunkTable.from_chunks(write_shard(fs, base, file, pieces))
            else:
                self.rows = ChunkTable.from_chunks([])
            self.upload_seconds = time.perf_counter() - started
        except BaseException as error:  # reported to the driver, which decides what it means
            self.error = f"{self.where}: {type(error).__name__}: {error}"
        finally:
            self._done.set()

    def _copy(self, live: list[Piece], keys: list[tuple]) -> list[Piece]:
        copies = self.staging.copy(keys, [piece.tensor for piece in live])
        return [Piece(piece.name, piece.kind, copy, piece.global_shape, piece.offsets) for piece, copy in zip(live, copies)]

    def status(self, wait: bool = False, timeout_s: float | None = None) -> dict:
        """{"done", "rows" (a `ChunkTable`), "error", timings}; wait=True blocks until the upload
        ends, or at most timeout_s (then "done" is False)."""
        if wait:
            self._done.wait(timeout_s)
        done = self._done.is_set()
        return {"done": done, "rows": self.rows if done else None, "error": self.error if done else None,
                "copy_seconds": self.copy_seconds, "upload_seconds": self.upload_seconds,
                "optimizer_wait_seconds": self.optimizer_wait_seconds}
