"""file://: a local (or network-mounted) directory.

Create-only is link(): it fails if the name exists, atomically, and the bytes are fsynced before
the name appears. Compare-and-replace holds an flock on a lock file beside the object, which
serialises writers on this machine, and renames the new bytes into place.

Durable as the commit needs it (a power loss, not only a killed process): a shard file's bytes and
its directory entry are on disk when its writer closes, before the first rank can publish the
manifest naming it; the manifest's link is synced with its directory and that directory's parent.
torch DCP's FileSystemWriter syncs its files too (`sync_files=True` by default).
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
        directory = os.path.dirname(path)
        _sync_directory(directory)  # the new name (a manifest's: beside its attempt's directory, also named here)
        _sync_directory(os.path.dirname(directory))  # (a manifest's) the step directory's own name

    @contextlib.contextmanager
    def open_writer(self, path: str):
        with open(path, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())  # only once the block ended without an error
        _sync_directory(os.path.dirname(path))

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


def _sync_directory(directory: str) -> None:
    """A directory's entries on disk (a new file's name survives a power loss only then)."""
    descriptor = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
