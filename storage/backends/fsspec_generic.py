"""Any fsspec filesystem without a backend of its own (memory:// in tests, a mounted path).

Conditional writes are check-then-write under a lock of this process: enough for one process
(memory:// in tests), not for writers in several. Stores that several processes write register a
backend with real conditional writes; this class is also their base for what needs nothing
special (ranged reads, plain replacement).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

from fsspec import AbstractFileSystem

from rayshard.plans.checkpoint.reshard import Request
from rayshard.storage.backends.protocol import PendingUpload, PreconditionFailed
from rayshard.storage.ranged_fetch import fetch_ranges

_process_lock = threading.Lock()


class FsspecBackend:
    scheme = "fsspec"
    local_paths = False
    short_ranges_are_cheap = False  # every range is its own GET

    def __init__(self, fs: AbstractFileSystem):
        self.fs = fs

    def url(self, path: str) -> str:
        return f"{self.scheme}://{path}"

    def create_only(self, path: str, data: bytes) -> None:
        with _process_lock:
            if self.fs.exists(path):
                raise FileExistsError(path)
            self.fs.pipe_file(path, data)

    def read_versioned(self, path: str) -> tuple[bytes | None, str | None]:
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError:
            return None, None
        return data, data.hex()  # the content is its own version where the store has no ETag

    def replace_if(self, path: str, data: bytes, token: str | None) -> None:
        with _process_lock:
            self.swap_if_unchanged(path, data, token)

    def swap_if_unchanged(self, path: str, data: bytes, token: str | None) -> None:
        """The comparison and the write, for a caller that holds the lock writers share."""
        if self.read_versioned(path)[1] != token:
            raise PreconditionFailed(path)
        self.replace(path, data)

    def replace(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(path, data)

    @contextlib.contextmanager
    def open_writer(self, path: str):
        with self.fs.open(path, "wb") as handle:
            yield handle

    def pending_uploads(self, root: str) -> list[PendingUpload]:
        return []  # a store without multipart uploads leaves none behind

    def abort_upload(self, upload: PendingUpload) -> None:
        raise NotImplementedError(f"{self.scheme} stores have no multipart uploads to abort ({upload.path})")

    def fetch_ranges(self, base: str, requests: Sequence[Request],
                     budget_bytes: int) -> Iterator[tuple[Request, bytes | BaseException]]:
        return fetch_ranges(self.fs, base, requests, budget_bytes)

    def make_directory(self, directory: str) -> None:
        """Object stores have no directories: a key's prefix exists once the key does."""

    def remove_empty_directory(self, directory: str) -> None:
        """Nothing to remove where directories do not exist (and s3fs's rmdir removes buckets)."""

    def missing_container(self, root: str) -> str | None:
        return None  # a directory tree: its root is made as it is written
