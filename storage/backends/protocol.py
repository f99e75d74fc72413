"""What rayshard needs of an object store, as one protocol.

The commit protocol (docs/checkpoint-format.md, "Commit protocol") needs an object created only if
it does not exist (the manifest) and one replaced only if it is still the version read (LATEST);
saves need a streaming writer with bounded memory; gc needs the uploads a dead process left
behind; loads need ranged reads. Stores offer these differently (S3's conditional PUTs and
multipart uploads, a local disk's link() and flock), so each store implements them once in its
own module and registers its URL schemes in `registry.py`: no caller branches on the scheme.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import BinaryIO, Protocol, runtime_checkable

from fsspec import AbstractFileSystem

from rayshard.plans.checkpoint.reshard import Request
from rayshard.plans.errors import StoreUnavailable


class PreconditionFailed(Exception):
    """The object changed (or appeared) since it was read: another writer got there first."""


def refuse_missing_container(backend: "Backend", path: str) -> None:
    """Raise StoreUnavailable where a conditional write failed because path's bucket (container)
    does not exist, which the store answers as it answers a missing object: without this it reads
    as a lost compare-and-swap, and a writer blames another trainer."""
    missing = backend.missing_container(path)
    if missing is not None:
        raise StoreUnavailable(f"{backend.url(path)}: its bucket (container) {missing!r} does not exist. Fix: create it, "
                               "or correct --store")


@dataclass(frozen=True)
class PendingUpload:
    """A multipart upload started and never completed or aborted: its parts cost storage, and no
    listing shows them."""

    path: str  # the object's path as the filesystem names it (bucket/key)
    upload_id: str
    initiated_unix: float


@runtime_checkable
class Backend(Protocol):
    fs: AbstractFileSystem
    scheme: str  # the URL scheme that names this store (file, s3, ...)
    # Paths are files on this machine: read them with os calls, and directories exist (they are
    # made before a file goes in, and an emptied one stays until removed).
    local_paths: bool
    # Many short ranges of one file cost about what their bytes cost, not a request each (local
    # preads; the snapshot keepers' one call per file): a column slice is read as one exact range
    # per row, never as whole rows (docs/decisions.md 114, 218).
    short_ranges_are_cheap: bool

    def url(self, path: str) -> str:
        """The URL a person (or another process) uses for a path of this filesystem."""

    def create_only(self, path: str, data: bytes) -> None:
        """Write path only if it does not exist; FileExistsError otherwise. A retried request
        whose first try landed counts as ours when the bytes are the same."""

    def read_versioned(self, path: str) -> tuple[bytes | None, str | None]:
        """(content, version token) of path, or (None, None) if it does not exist."""

    def replace_if(self, path: str, data: bytes, token: str | None) -> None:
        """Write path only if it still holds version `token` (None: only if it does not exist);
        PreconditionFailed when another writer changed it in between."""

    def replace(self, path: str, data: bytes) -> None:
        """Write path whole, unconditionally; a reader sees the old bytes or the new, never a mix."""

    def open_writer(self, path: str) -> AbstractContextManager[BinaryIO]:
        """A binary file-like to stream one object into, in bounded memory; the object exists
        once the block exits without an error, and not at all when it raises."""

    def pending_uploads(self, root: str) -> list[PendingUpload]:
        """Uploads under root that were started and never completed or aborted."""

    def abort_upload(self, upload: PendingUpload) -> None: ...

    def fetch_ranges(self, base: str, requests: Sequence[Request],
                     budget_bytes: int) -> Iterator[tuple[Request, bytes | BaseException]]:
        """Ranged reads of `{base}/{request.file}`, in completion order, with at most
        budget_bytes fetched and not yet consumed."""

    def make_directory(self, directory: str) -> None:
        """Where directories exist, make one (and its parents) before files go in."""

    def remove_empty_directory(self, directory: str) -> None:
        """Where directories exist, remove this one if it is empty (a save that has just started
        writing in it keeps it)."""

    def missing_container(self, root: str) -> str | None:
        """The bucket (container) holding root when it does not exist, else None. A store never
        creates one: s3fs's makedirs would, at the first save, with the wrong region and policy."""
