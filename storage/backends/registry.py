"""Which backend serves a URL: one row per scheme.

A new store is one module implementing `protocol.Backend` (usually a subclass of
`fsspec_generic.FsspecBackend`) and one row here. A scheme without a row still works through
fsspec with process-local conditional writes (`FsspecBackend`): fine for memory:// in tests, not
for several writers.
"""
from __future__ import annotations

import fsspec
from fsspec import AbstractFileSystem

from rayshard.storage.backends.azure import AzureBackend
from rayshard.storage.backends.fsspec_generic import FsspecBackend
from rayshard.storage.backends.local import LocalBackend
from rayshard.storage.backends.protocol import Backend
from rayshard.storage.backends.s3 import S3Backend

BACKENDS: dict[str, type[FsspecBackend]] = {
    "file": LocalBackend,
    "local": LocalBackend,
    "s3": S3Backend,
    "s3a": S3Backend,
    "az": AzureBackend,
    "abfs": AzureBackend,
    "abfss": AzureBackend,
}


def scheme_of(fs: AbstractFileSystem) -> str:
    """The filesystem's main URL scheme (fsspec gives one name or a tuple of aliases)."""
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def backend_for(fs: AbstractFileSystem) -> Backend:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    for protocol in protocols:
        if protocol in BACKENDS:
            return BACKENDS[protocol](fs)
    backend = FsspecBackend(fs)
    backend.scheme = scheme_of(fs)
    return backend


def open_url(url: str) -> tuple[Backend, str]:
    """The backend serving url, and the path within it that url names."""
    fs, path = fsspec.core.url_to_fs(url)
    return backend_for(fs), path
