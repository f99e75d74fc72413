"""Where an export writes: a new or empty directory, filled in full or not at all.

On a local file system an export writes into `OUT.partial-<id>` beside its --out and renames it
into place as its last step (one step), and removes it when the export fails: a failed or killed
export leaves no half-written --out that a retry would refuse and a reader might take for whole
(`ckpt import`, transformers' `from_pretrained`, `dcp.load`). On an object store, where a prefix
has no rename, the export writes --out itself; a DCP export's `.metadata` goes last there, so a
reader finds no checkpoint before it is whole.
"""
from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator

from fsspec.implementations.local import LocalFileSystem

from rayshard.plans.errors import CheckpointError


def refuse_non_empty(fs, out: str, directory: str) -> None:
    """An export's --out must be new or empty: stale shards or an old index beside the new files
    would be read back as part of this export."""
    present = sorted(path.rstrip("/").rsplit("/", 1)[-1] for path in fs.ls(out, detail=False)) if fs.isdir(out) else []
    if present:
        raise CheckpointError(f"{directory}: already holds {', '.join(present[:4])}{' ...' if len(present) > 4 else ''}; "
                              "an export into it would mix with those files. Fix: export to a new or empty directory, "
                              "or remove it first")
    if fs.exists(out) and not fs.isdir(out):
        raise CheckpointError(f"{directory}: is a file. Fix: export to a new or empty directory")


def staged_url(staging: str, out: str, directory: str) -> str:
    """What a writer that takes a URL (the tokenizer's copy) names the staging directory by: the
    path itself where it is a local one, else --out as given."""
    return directory if staging == out else staging


@contextlib.contextmanager
def published_when_done(fs, out: str, directory: str) -> Iterator[str]:
    """The path to write the export into; published as `out` once the block ends without an
    error, removed when it raises (local file systems; elsewhere `out` itself)."""
    staging = f"{out}.partial-{uuid.uuid4().hex[:8]}" if isinstance(fs, LocalFileSystem) else out
    fs.makedirs(staging, exist_ok=True)
    try:
        yield staging
        if staging != out:
            if fs.isdir(out):
                refuse_non_empty(fs, out, directory)  # another writer may have filled it meanwhile
                os.rmdir(out)
            os.rename(staging, out)
    except BaseException:
        if staging != out:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(staging, recursive=True)
        raise
