"""A deadline on each storage call a catalog command makes, named when it passes.

botocore bounds each request (connect and read timeouts, a number of attempts) and s3fs retries
on top, so one call to a silent or throttling server could take many minutes with nothing
printed. The catalog's file system is wrapped here: each call of an async file system (s3fs)
runs through fsspec's `sync(..., timeout=)`, which cancels it at the deadline, and the error
names the call, its path and the bound (decision 102). Local file systems answer or fail at once
and are used as they are.
"""
from __future__ import annotations

import inspect

from fsspec.exceptions import FSTimeoutError

# The calls the catalog makes (cluster/catalog/): listings, HEADs, reads, writes, deletes.
BOUNDED_CALLS = frozenset({"exists", "ls", "find", "info", "isdir", "isfile", "cat", "cat_file", "pipe_file",
                           "makedirs", "mkdir", "rm", "rm_file", "du", "glob", "call_s3"})


class StorageCallTimeout(TimeoutError):
    """A storage call got no answer within its bound (an OSError: exit 3, like any storage failure)."""


class BoundedFileSystem:
    """`fs` with each of its BOUNDED_CALLS cut off after `seconds`."""

    def __init__(self, fs, seconds: float):
        self._fs, self._seconds = fs, seconds

    def __getattr__(self, name: str):
        attribute = getattr(self._fs, name)
        if name not in BOUNDED_CALLS or not _runs_through_sync(attribute):
            return attribute  # a method a file system wrote synchronously (adlfs's isdir) takes no deadline

        def bounded(*args, **kwargs):
            try:
                return attribute(*args, timeout=self._seconds, **kwargs)  # fsspec's sync() takes it
            except FSTimeoutError:
                target = args[0] if args and isinstance(args[0], str) else (f"{len(args[0])} paths" if args else "")
                raise StorageCallTimeout(
                    f"{name}({target}) got no answer within {self._seconds:g} s, retries included; the store is "
                    "unreachable or throttling (raise the bound with RAYSHARD_S3_CALL_TIMEOUT_S)") from None
        return bounded


def _runs_through_sync(attribute) -> bool:
    """fsspec's blocking wrapper of a coroutine method (it takes `timeout=`), not a method the
    file system wrote as a plain function; its SDK's own request timeouts bound that one."""
    return callable(attribute) and inspect.iscoroutinefunction(getattr(attribute, "__wrapped__", None))


def bounded(fs, seconds: float):
    """fs itself where calls cannot hang on a network (no event loop), else a BoundedFileSystem."""
    return BoundedFileSystem(fs, seconds) if getattr(fs, "async_impl", False) else fs
