"""Where runs and checkpoints live in a store (any fsspec URL), and how they are addressed.

    {store}/{run}/LATEST                                   name of the newest committed checkpoint
    {store}/{run}/metrics.jsonl                            one JSON line per training step
    {store}/{run}/checkpoints/step-00000020/manifest.parquet           the commit
    {store}/{run}/checkpoints/step-00000020/attempt-<id>/rank-00003.safetensors

A checkpoint exists once its manifest exists: shards are written first under an attempt-unique
prefix, the manifest last with create-only semantics, then LATEST moves by compare-and-swap (the
protocol is in docs/checkpoint-format.md, "Commit protocol"). A save that dies before the
manifest leaves only an orphaned attempt directory, never a visible checkpoint.

On every command a checkpoint is `RUN[@STEP]` within the store (the latest committed one when no
step is given), `latest` (the current run's), or the URL of a checkpoint directory.
"""
from __future__ import annotations

import copy
import re
import sys
import uuid
from dataclasses import dataclass

import fsspec

from rayshard.storage.manifest_io import read_manifest
from rayshard.storage import options as storage_options
from rayshard.storage.backends.protocol import PreconditionFailed
from rayshard.storage.bounded_calls import bounded
from rayshard.storage.backends.registry import backend_for
from rayshard.storage.options import StorageOptions
from rayshard.cluster.catalog.pending import PendingCheckpoint
from rayshard.plans.checkpoint.manifest.codec import MANIFEST
from rayshard.plans.errors import CheckpointError, ConfigError, StoreUnavailable, first_line
from rayshard.plans.redaction import Redactor, carries_credentials
from rayshard.plans.run_names import check_checkpoint_ref, is_location

STEP_DIR = re.compile(r"^step-(\d{8})$")
_WARNED_LATEST: set[tuple[str, str]] = set()  # (store URL, run) whose damaged LATEST was reported


@dataclass(frozen=True)
class CheckpointRef:
    url: str
    run: str | None
    step: int | None


def resumed_step(latest: int | None, committed: list[int]) -> int | None:
    """The step `latest` resolves to: the one LATEST names where it is committed, else (LATEST
    missing, damaged or dangling) the newest committed step (decision 88)."""
    return latest if latest in committed or not committed else committed[-1]


def step_named(latest: bytes | None) -> int | None:
    """The step a LATEST object's bytes name. One that is not a step's name (damaged, even
    binary) points nowhere, as a missing one."""
    match = STEP_DIR.match((latest or b"").decode("utf-8", "replace").strip())
    return int(match.group(1)) if match else None


# Eight digits, as STEP_DIR (and so every listing) reads a step's directory back.
MAX_STEP = 99_999_999


def step_dirname(step: int) -> str:
    if not 0 <= step <= MAX_STEP:
        raise ConfigError("step", step, f"must be between 0 and {MAX_STEP:,} (a checkpoint's directory holds eight digits)",
                          "number the steps within that range")
    return f"step-{step:08d}"


class Store:
    def __init__(self, url: str, options: StorageOptions | None = None):
        # Object-store options apply process-wide (fsspec's config), so the driver's own reads and
        # the rank actors (which receive `storage_conf`) use one endpoint, retry and timeout policy.
        self.storage_conf = storage_options.configure(options)
        self._open(url)

    def _open(self, url: str) -> None:
        refuse_credentials(url, "--store")
        self.url = url.rstrip("/") or url
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        self.backend = backend_for(self.fs)  # conditional writes, uploads: the store's own way

    def require_container(self) -> "Store":
        """This store, once its bucket is known to exist (a local store needs nothing)."""
        missing = self.backend.missing_container(self.root)
        if missing is not None and self.backend.scheme == "az":
            raise StoreUnavailable(f"--store={self.url!r}: its container {missing!r} does not exist in the storage account. "
                                   f"Fix: create it (az storage container create --name {missing}), or correct --store")
        if missing is not None:
            raise StoreUnavailable(f"--store={self.url!r}: its bucket {missing!r} does not exist (at "
                                   f"{self.storage_conf.get('s3', {}).get('endpoint_url') or 'the default S3 endpoint'}). "
                                   f"Fix: create it (aws s3 mb s3://{missing}), or correct --store or AWS_ENDPOINT_URL")
        return self

    def with_bounded_calls(self) -> "Store":
        """This store with a deadline on each of its file-system calls (storage.call_timeout_s),
        for the catalog commands: a silent store ends in one line naming the call, not a wait."""
        other = copy.copy(self)
        other.fs = bounded(self.fs, StorageOptions(**self.storage_conf["rayshard"]).call_timeout_s)
        other.backend = copy.copy(self.backend)  # HeadBucket, multipart listings and aborts, conditional writes
        other.backend.fs = other.fs
        other.backend.fetch_ranges = self.backend.fetch_ranges  # shard reads: fsspec's own loop, bounded per range
        return other

    def at(self, url: str) -> "Store":
        """Another store under this one's storage options (endpoint, retries), without applying
        them to the process again; this store itself when url names it."""
        if (url.rstrip("/") or url) == self.url:
            return self
        other = object.__new__(Store)
        other.storage_conf = self.storage_conf
        other._open(url)
        return other

    def _url(self, path: str) -> str:
        return self.backend.url(path)

    def run_path(self, run: str) -> str:
        return f"{self.root}/{run}"

    def checkpoint_url(self, run: str, step: int) -> str:
        return self._url(self.checkpoint_path(run, step))

    def checkpoint_path(self, run: str, step: int) -> str:
        """run@step's directory as this store's file system names it (no protocol)."""
        return f"{self.root}/{run}/checkpoints/{step_dirname(step)}"

    def new_attempt(self) -> str:
        return f"attempt-{uuid.uuid4().hex[:12]}"

    # ---- listing ----------------------------------------------------------------------------

    def runs(self) -> list[str]:
        if not self.fs.exists(self.root):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)
                      if self.fs.isdir(p) and self.fs.exists(f"{p}/checkpoints"))

    def refuse_committed(self, run: str, step: int, fix: str) -> None:
        """Before a writer starts: a committed step is never written again, so a second writer of
        it would write every byte only to lose the commit (and leave them behind)."""
        if step in self.committed_steps(run):
            raise CheckpointError(f"{run}@{step} is already committed in {self.url}; a checkpoint is never overwritten. "
                                  f"Fix: {fix}")

    def is_committed(self, run: str, step: int) -> bool:
        """Whether run@step has its manifest: one request, where `committed_steps` makes one per
        step of the run (a run of 1,200 checkpoints took 17 s to resolve RUN@STEP)."""
        return 0 <= step <= MAX_STEP and self.fs.exists(f"{self.checkpoint_path(run, step)}/{MANIFEST}")

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
        return step_named(self.fs.cat_file(path)) if self.fs.exists(path) else None

    # ---- addressing -------------------------------------------------------------------------

    def resolve(self, ref: str, current_run: str | None = None) -> CheckpointRef:
        """Turn `latest`, `RUN`, `RUN@STEP` or a checkpoint URL into a committed checkpoint."""
        if is_location(ref):
            refuse_credentials(ref, "checkpoint")
            fs, path = fsspec.core.url_to_fs(ref)
            if not fs.exists(f"{path.rstrip('/')}/{MANIFEST}"):
                raise CheckpointError(f"{ref}: no {MANIFEST} there, so it is not a committed checkpoint. "
                                      "Fix: pass a checkpoint directory (…/checkpoints/step-NNNNNNNN) or RUN[@STEP] with --store")
            check_manifest_keys(ref.rstrip("/"))
            return CheckpointRef(ref.rstrip("/"), None, None)
        check_checkpoint_ref(ref, "checkpoint")  # a RUN such as '..' would read outside the store
        run, _, step_text = ref.partition("@")
        if run == "latest":
            if not current_run:
                raise CheckpointError("'latest' names the current run's newest checkpoint, and there is no current run "
                                      "here. Fix: address the checkpoint as RUN (its newest) or RUN@STEP")
            run = current_run
        if step_text:
            if not (step_text.isascii() and step_text.isdigit()):  # not '²' (int() refuses) nor '٢٠' (int() reads 20)
                raise CheckpointError(f"{ref}: the step after '@' must be a number, e.g. {run}@20")
            step = int(step_text)
            if not self.is_committed(run, step):
                self.require_container()  # a bucket that does not exist is the answer, not "no such step"
                raise CheckpointError(f"{run}@{step}: no committed checkpoint at that step in {self.url}. "
                                      f"Committed steps: {self.committed_steps(run) or 'none'}")
        else:
            step = self.latest_step(run)
            pointed = step is not None and self.fs.exists(f"{self.root}/{run}/checkpoints/{step_dirname(step)}/{MANIFEST}")
            committed = () if pointed else self.committed_steps(run)
            if committed:
                # A manifest is written last, so each committed step is whole; LATEST only names the
                # newest. Missing (a crash between the first manifest and its LATEST) or damaged, the
                # newest committed step is what it would name: an elastic restart must not stop here.
                step = resumed_step(step, committed)
                if (self.url, run) not in _WARNED_LATEST:  # once per process: a resume resolves twice
                    _WARNED_LATEST.add((self.url, run))
                    print(f"rayshard: warning: run {run!r}: its LATEST pointer in {self.url} is missing, damaged or names no checkpoint; "
                      f"using the newest committed step, {step} (the next commit rewrites LATEST)",
                          file=sys.stderr)
            elif not pointed:
                self.require_container()  # a bucket that does not exist is the answer, not "no checkpoint"
                raise CheckpointError(f"run {run!r} has no committed checkpoint in {self.url}. "
                                      f"Runs with checkpoints there: {self.runs() or 'none'}")
        url = self.checkpoint_url(run, step)
        check_manifest_keys(url)
        return CheckpointRef(url, run, step)

    # ---- commit -----------------------------------------------------------------------------

    def begin(self, run: str, step: int) -> PendingCheckpoint:
        """Start writing run@step under a fresh attempt directory; `commit` on the result makes
        it visible. Every writer of checkpoints starts here."""
        return PendingCheckpoint(self, run, step, self.checkpoint_url(run, step), self.new_attempt())

    def commit(self, run: str, step: int, manifest: bytes) -> str:
        """The protocol's two conditional writes (writers call it through `begin(...).commit`):
        create the manifest (never overwriting one), then move LATEST by compare-and-swap.

        Two writers committing the same step: the create-only manifest admits exactly one, the
        other gets a CheckpointError and its shards stay an orphaned attempt for `ckpt gc`. Two
        writers committing different steps at once: both checkpoints are whole; LATEST names the
        one whose swap won and the other writer gets a CheckpointError. Returns the URL."""
        name = step_dirname(step)
        directory = f"{self.root}/{run}/checkpoints/{name}"
        url = self._url(directory)
        latest = f"{self.root}/{run}/LATEST"
        # Read before the manifest exists: a swap that still matches proves nobody moved LATEST
        # while this commit was in flight.
        _, version = self.backend.read_versioned(latest)
        self.backend.make_directory(directory)
        try:
            self.backend.create_only(f"{directory}/{MANIFEST}", manifest)
        except FileExistsError:
            raise CheckpointError(
                f"{run}@{step}: another writer committed this checkpoint first ({url}); this save's shards are "
                "left as an orphaned attempt that `rayshard ckpt gc` removes. Fix: run one trainer per run — "
                "continue it with --resume latest, or train under a new --run name") from None
        try:
            self.backend.replace_if(latest, name.encode(), version)
        except PreconditionFailed:
            raise CheckpointError(
                f"{run}@{step} is committed ({url}), but another writer moved LATEST (now step "
                f"{self.latest_step(run)}) while this save was committing, so LATEST names the other writer's "
                f"checkpoint. Fix: run one trainer per run; address this one as {run}@{step}") from None
        except OSError as error:  # the store failed the swap: the checkpoint is whole, only the pointer is old
            raise StoreUnavailable(
                f"{run}@{step} is committed ({url}), but moving LATEST to it failed "
                f"({type(error).__name__}: {first_line(error)}), so "
                f"LATEST still names step {self.latest_step(run)}. Fix: address this one as {run}@{step}; the run's "
                "next commit moves LATEST past it") from None
        return url

    def write_text(self, relative: str, text: str) -> None:
        path = f"{self.root}/{relative}"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        self.backend.replace(path, text.encode())

    def read_text(self, relative: str) -> str | None:
        path = f"{self.root}/{relative}"
        return self.fs.cat_file(path).decode() if self.fs.exists(path) else None


def check_manifest_keys(checkpoint_url: str) -> None:
    """Refuse a checkpoint whose manifest names objects outside its own directory (read_manifest
    does the check, so resolving a ref fails early, before a command starts reading)."""
    read_manifest(checkpoint_url)


def refuse_credentials(url: str, field: str) -> None:
    """A URL with credentials in it is refused before any request, without echoing them: s3fs
    would take "key:secret@bucket" as a bucket name and botocore print it."""
    if carries_credentials(url):
        kind = "store" if field == "--store" else "checkpoint"
        raise ConfigError(field, Redactor().redact(url), f"a {kind} URL cannot carry credentials",
                          "give them as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AZURE_STORAGE_* variables) or "
                          "a profile in the environment, and the URL as s3://bucket/prefix")
