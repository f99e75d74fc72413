"""file://: a local (or network-mounted) directory.

Create-only is link(): it fails if the name exists, atomically, and the bytes are fsynced before
the name appears. Compare-and-replace holds an flock on a lock file beside the object, which
serialises writers on this machine, and renames the new bytes into place.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import uuid

from rayshard.storage.backends.fsspec_generic import FsspecBackend


class LocalBackend(FsspecBackend):
    scheme = "file"
    local_paths = True
    short_ranges_are_cheap = True

    def url(self, path: str) -> str:
        return path  # a local path is its own URL, as a person types it

    def create_only(self, path: str, data: bytes) -> None:
        temporary = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temporary, path)  # fails if the name exists, atomically
        finally:
            os.unlink(temporary)

    def replace_if(self, path: str, data: bytes, token: str | None) -> None:
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # serialises writers on this machine
            self.swap_if_unchanged(path, data, token)

    def replace(self, path: str, data: bytes) -> None:
        temporary = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)

    def make_directory(self, directory: str) -> None:
        self.fs.makedirs(directory, exist_ok=True)

    def remove_empty_directory(self, directory: str) -> None:
        with contextlib.suppress(OSError):
            self.fs.rmdir(directory)
