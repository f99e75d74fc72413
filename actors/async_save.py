"""A rank's asynchronous save: training waits only while the rank's share of the state is copied
to CPU; the upload then streams from that copy in a background thread while training goes on.

The copy is what makes it safe: the optimizer updates the live tensors in the next step, the
upload reads a snapshot taken between steps. Its memory is the rank's share of the checkpoint in
host memory (what torch DCP's async save also pays), kept between saves so the next staging is a
plain copy with no allocation or page faults on the critical path, plus the streaming writer's
bounded part buffers. A save never restages while the previous upload still reads the buffers.
The driver polls `status`; a failed upload is returned as text naming the rank and the object,
never raised here, so the driver can report it at the next step.
"""
from __future__ import annotations

import threading
import time

import fsspec
import torch

from actors.checkpoint_io import write_shard
from actors.checkpointing import pieces_to_write


_staging: dict[tuple, torch.Tensor] = {}  # (name, kind, offsets) -> host buffer, reused across saves
_previous: "BackgroundSave | None" = None


def _host_copy(key: tuple, tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.detach()
    buffer = _staging.get(key)
    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
        buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
        _staging[key] = buffer
    return buffer.copy_(tensor, non_blocking=tensor.is_cuda)


class BackgroundSave:
    def __init__(self, model, optimizer, checkpoint_url: str, file: str, rank: int):
        global _previous
        if _previous is not None:
            _previous.status(wait=True)  # its upload reads the staging buffers about to be overwritten
        started = time.perf_counter()
        self.where = f"rank {rank} ({checkpoint_url}/{file})"
        pieces = pieces_to_write(model, optimizer)
        keys = [(name, kind, tuple(offsets)) for name, kind, _, _, offsets in pieces]
        for stale in set(_staging) - set(keys):  # another model or layout since the last save
            del _staging[stale]
        self.pieces = [(name, kind, _host_copy(key, tensor), shape, offsets)
                       for key, (name, kind, tensor, shape, offsets) in zip(keys, pieces)]
        _previous = self
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies must land before training moves on
        self.staged = {"bytes": sum(p[2].numel() * p[2].element_size() for p in self.pieces),
                       "seconds": time.perf_counter() - started}
        self.rows: list[dict] | None = None
        self.error: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._upload, args=(checkpoint_url, file), name="checkpoint-upload",
                                        daemon=True)
        self._thread.start()

    def _upload(self, checkpoint_url: str, file: str) -> None:
        started = time.perf_counter()
        try:
            if self.pieces:
                fs, base = fsspec.core.url_to_fs(checkpoint_url)
                self.rows = [chunk.to_row() for chunk in write_shard(fs, base, file, self.pieces)]
            else:
                self.rows = []
        except BaseException as error:  # reported to the driver, which decides what it means
            self.error = f"{self.where}: {type(error).__name__}: {error}"
        finally:
            self.pieces = None  # the buffers stay in _staging for the next save
            self.upload_seconds = time.perf_counter() - started
            self._done.set()

    def status(self, wait: bool = False) -> dict:
        """{"done", "rows", "error", "upload_seconds"}; wait=True blocks until the upload ends."""
        if wait:
            self._done.wait()
        done = self._done.is_set()
        return {"done": done, "rows": self.rows if done else None, "error": self.error if done else None,
                "upload_seconds": getattr(self, "upload_seconds", None)}
