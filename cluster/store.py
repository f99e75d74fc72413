"""Where runs and checkpoints live in a store (any fsspec URL), and how they are addressed.

    {store}/{run}/LATEST                                   name of the newest committed checkpoint
    {store}/{run}/metrics.jsonl                            one JSON line per training step
    {store}/{run}/checkpoints/step-00000020/manifest.parquet           the commit
    {store}/{run}/checkpoints/step-00000020/attempt-<id>/rank-00003.safetensors

A checkpoint exists once its manifest exists: shards are written first under an attempt-unique
prefix, the manifest last with create-only semantics, then LATEST moves. A save that dies before
the manifest leaves only an orphaned attempt directory, never a visible checkpoint.

On every command a checkpoint is `RUN[@STEP]` within the store (the latest committed one when no
step is given), `latest` (the current run's), or the URL of a checkpoint directory.
"""
from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass

import fsspec
from fsspec.implementations.local import LocalFileSystem

from actors.checkpointing import MANIFEST
from plans.errors import CheckpointError

STEP_DIR = re.compile(r"^step-(\d{8})$")


@dataclass(frozen=True)
class CheckpointRef:
    url: str
    run: str | None
    step: int | None


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


class Store:
    def __init__(self, url: str):
        self.url = url.rstrip("/") or url
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self._protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]

    def _url(self, path: str) -> str:
        return path if self._protocol in ("file", "local") else f"{self._protocol}://{path}"

    def run_path(self, run: str) -> str:
        return f"{self.root}/{run}"

    def checkpoint_url(self, run: str, step: int) -> str:
        return self._url(f"{self.root}/{run}/checkpoints/{step_dirname(step)}")

    def new_attempt(self) -> str:
        return f"attempt-{uuid.uuid4().hex[:12]}"

    # ---- listing ----------------------------------------------------------------------------

    def runs(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)
                      if self.fs.isdir(p) and self.fs.exists(f"{p}/checkpoints"))

    def committed_steps(self, run: str) -> list[int]:
        base = f"{self.root}/{run}/checkpoints"
        if not self.fs.exists(base):
            return []
        steps = []
        for path in self.fs.ls(base, detail=False):
            match = STEP_DIR.match(path.rstrip("/").rsplit("/", 1)[-1])
            if match and self.fs.exists(f"{path}/{MANIFEST}"):
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_step(self, run: str) -> int | None:
        path = f"{self.root}/{run}/LATEST"
        if not self.fs.exists(path):
            return None
        match = STEP_DIR.match(self.fs.cat_file(path).decode().strip())
        return int(match.group(1)) if match else None

    # ---- addressing -------------------------------------------------------------------------

    def resolve(self, ref: str, current_run: str | None = None) -> CheckpointRef:
        """Turn `latest`, `RUN`, `RUN@STEP` or a checkpoint URL into a committed checkpoint."""
        if "://" in ref or ref.startswith(("/", "./", "../")) or os.sep in ref.split("@")[0]:
            fs, path = fsspec.core.url_to_fs(ref)
            if not fs.exists(f"{path.rstrip('/')}/{MANIFEST}"):
                raise CheckpointError(f"{ref}: no {MANIFEST} there, so it is not a committed checkpoint. "
                                      "Fix: pass a checkpoint directory (…/checkpoints/step-NNNNNNNN) or RUN[@STEP] with --store")
            return CheckpointRef(ref.rstrip("/"), None, None)
        run, _, step_text = ref.partition("@")
        if run == "latest":
            if not current_run:
                raise CheckpointError("'latest' needs a run: pass --run NAME, or address the checkpoint as RUN[@STEP]")
            run = current_run
        if step_text:
            if not step_text.isdigit():
                raise CheckpointError(f"{ref}: the step after '@' must be a number, e.g. {run}@20")
            step = int(step_text)
            if step not in self.committed_steps(run):
                raise CheckpointError(f"{run}@{step}: no committed checkpoint at that step in {self.url}. "
                                      f"Committed steps: {self.committed_steps(run) or 'none'}")
        else:
            step = self.latest_step(run)
            if step is None:
                raise CheckpointError(f"run {run!r} has no committed checkpoint in {self.url}. "
                                      f"Runs with checkpoints there: {self.runs() or 'none'}")
        return CheckpointRef(self.checkpoint_url(run, step), run, step)

    # ---- commit -----------------------------------------------------------------------------

    def commit(self, run: str, step: int, manifest: bytes) -> str:
        """Create the manifest (never overwriting one) and then move LATEST. Returns the URL."""
        directory = f"{self.root}/{run}/checkpoints/{step_dirname(step)}"
        self.fs.makedirs(directory, exist_ok=True)
        _create_only(self.fs, f"{directory}/{MANIFEST}", manifest)
        _replace(self.fs, f"{self.root}/{run}/LATEST", step_dirname(step).encode())
        return self._url(directory)

    def write_text(self, relative: str, text: str) -> None:
        path = f"{self.root}/{relative}"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        _replace(self.fs, path, text.encode())

    def read_text(self, relative: str) -> str | None:
        path = f"{self.root}/{relative}"
        return self.fs.cat_file(path).decode() if self.fs.exists(path) else None


def _create_only(fs, path: str, data: bytes) -> None:
    if isinstance(fs, LocalFileSystem):
        # Write aside, then hard-link into place: link() fails if the name exists, atomically.
        temporary = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            raise CheckpointError(f"{path} already exists: another writer committed this checkpoint first") from None
        finally:
            os.unlink(temporary)
        return
    if fs.exists(path):
        raise CheckpointError(f"{path} already exists: another writer committed this checkpoint first")
    fs.pipe_file(path, data)


def _replace(fs, path: str, data: bytes) -> None:
    if isinstance(fs, LocalFileSystem):
        temporary = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
        return
    fs.pipe_file(path, data)
