"""Which backend serves a URL: one row per scheme.

A new store is one module implementing `protocol.Backend` (usually a subclass of
`fsspec_generic.FsspecBackend`) and one row here. A scheme without a row still works through
fsspec with process-local conditional writes (`FsspecBackend`): fine for memory:// in tests, not
for several writers.
"""
from __future__ import annotations

import fsspec
from fsspec import AbstractFileSystem

import importlib

from rayshard.storage.backends.fsspec_generic import FsspecBackend
from rayshard.storage.backends.protocol import Backend

# Module and class per scheme, imported when a URL of that scheme is first opened: a machine
# without the Azure SDK (or s3fs) still reads and writes local stores (the lent GPU image has
# neither, and a rank on it imports this module through every checkpoint path).
BACKEND_CLASSES: dict[str, tuple[str, str]] = {
    "file": ("rayshard.storage.backends.local", "LocalBackend"),
    "local": ("rayshard.storage.backends.local", "LocalBackend"),
    "s3": ("rayshard.storage.backends.s3", "S3Backend"),
    "s3a": ("rayshard.storage.backends.s3", "S3Backend"),
    "az": ("rayshard.storage.backends.azure", "AzureBackend"),
    "abfs": ("rayshard.storage.backends.azure", "AzureBackend"),
    "abfss": ("rayshard.storage.backends.azure", "AzureBackend"),
}


AZURE_SCHEMES = ("az", "abfs", "abfss")
AZURE_FILESYSTEM = "rayshard.storage.backends.azure_filesystem.BoundedRetryBlobFileSystem"
for _scheme in AZURE_SCHEMES:
    # fsspec opens az:// with rayshard's adlfs subclass (bounded retries, a quiet SDK log) from the
    # first URL on, so it is registered here, with the registry, not with the backend's module;
    # by name, so adlfs and the storage SDK (0.3 s) load only with the first az:// URL.
    fsspec.register_implementation(_scheme, AZURE_FILESYSTEM, clobber=True,
                                   errtxt="Azure Blob Storage needs adlfs: pip install adlfs")


def register_backend(scheme: str, module: str, name: str) -> None:
    """Serve scheme with module's class `name`: for a filesystem defined outside the storage
    layer (the snapshot keepers' `rayshard-snapshot://`, which needs Ray), registered when fsspec
    imports its module."""
    BACKEND_CLASSES[scheme] = (module, name)


def backend_class(scheme: str) -> type[FsspecBackend]:
    """The backend class registered for scheme (KeyError if none), imported on first use."""
    module, name = BACKEND_CLASSES[scheme]
    return getattr(importlib.import_module(module), name)


def scheme_of(fs: AbstractFileSystem) -> str:
    """The filesystem's main URL scheme (fsspec gives one name or a tuple of aliases)."""
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def backend_for(fs: AbstractFileSystem) -> Backend:
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    for protocol in protocols:
        if protocol in BACKEND_CLASSES:
            return backend_class(protocol)(fs)
    backend = FsspecBackend(fs)
    backend.scheme = scheme_of(fs)
    return backend


def open_url(url: str) -> tuple[Backend, str]:
    """The backend serving url, and the path within it that url names."""
    fs, path = fsspec.core.url_to_fs(url)
    return backend_for(fs), path
