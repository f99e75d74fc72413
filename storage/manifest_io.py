"""Fetching and decoding a committed checkpoint's manifest from its store.

Imports no torch: the catalog commands (`ckpt ls`, `ckpt show`) and the store use it.
"""
from __future__ import annotations

import fsspec

from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.checkpoint.manifest.codec import MANIFEST, decode_manifest
from rayshard.plans.checkpoint.manifest.object_keys import check_object_keys
from rayshard.plans.errors import CheckpointError


def manifest_bytes(checkpoint_url: str) -> bytes:
    """The committed manifest's bytes, as stored (a driver fetches them once and hands them to
    every rank of a load, instead of every rank fetching them)."""
    fs, base = fsspec.core.url_to_fs(checkpoint_url)
    try:
        return fs.cat_file(f"{base}/{MANIFEST}")
    except FileNotFoundError:
        raise CheckpointError(f"{checkpoint_url}/{MANIFEST} does not exist: not a committed checkpoint") from None


def read_manifest(checkpoint_url: str, data: bytes | None = None) -> tuple[ChunkTable, dict]:
    """The chunks and metadata of a committed checkpoint (data: its manifest's bytes, if already
    fetched). Every path that opens a checkpoint for reading (loads, resume, offline reshard,
    digest, diff, export, verify, gc) comes through here, so this is where a manifest naming
    objects outside its own directory (`..`, absolute paths, other buckets) is refused, before
    any shard byte is fetched."""
    where = f"{checkpoint_url}/{MANIFEST}"
    chunks, metadata = decode_manifest(manifest_bytes(checkpoint_url) if data is None else data, where)
    if not len(chunks):
        raise CheckpointError(f"{where}: the manifest lists no chunks, and a checkpoint holds at least one tensor: it "
                              "is damaged. Fix: resume from another checkpoint (`rayshard ckpt ls`)")
    check_object_keys(chunks.file_names(), checkpoint_url)  # each file once, not once per chunk
    return chunks, metadata
