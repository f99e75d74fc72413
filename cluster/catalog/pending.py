"""A checkpoint being written: where its shards go, and the one commit every writer ends with
(training saves, async saves, offline reshard, Hugging Face import), in the spirit of torch
DCP's `StorageWriter.finish`.

    pending = store.begin(run, step)          # a fresh attempt directory under the step's
    write_shard(..., pending.url, pending.file_for(rank), ...)   # every rank, in any order
    url = pending.commit(chunks, metadata)    # tiling checked, manifest created, LATEST moved

Nothing is visible before `commit`: a writer that dies first leaves an attempt directory that no
manifest names, which `ckpt gc` collects (docs/checkpoint-format.md, "Commit protocol").
Imports neither torch nor Ray, like the rest of the store.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.manifest.codec import encode_manifest
from rayshard.plans.checkpoint.reshard import check_chunks_disjoint_and_complete


@dataclass(frozen=True)
class PendingCheckpoint:
    store: Any  # the Store that began it (cluster/catalog/store.py)
    run: str
    step: int
    url: str  # the checkpoint directory: shard files are named relative to it; the manifest goes there
    attempt: str  # `attempt-<id>`: this writer's folder inside it, unique per save

    def file_for(self, rank: int, stem: str = "rank") -> str:
        """The shard file `rank` writes, relative to `url` (`import-NNNNN` files for stem="import")."""
        return f"{self.attempt}/{stem}-{rank:05d}.safetensors"

    def manifest(self, chunks: ChunkTable | Iterable[Chunk], metadata: dict) -> bytes:
        """The manifest that commits these chunks; refuses chunks that do not tile every tensor
        exactly (an overlap or a gap would make a checkpoint no layout can load)."""
        # A gathered ChunkTable stays columns: no record per chunk on the driver (16k ranks: 826k).
        chunks = chunks if isinstance(chunks, ChunkTable) else list(chunks)
        check_chunks_disjoint_and_complete(chunks)
        return encode_manifest(chunks, metadata)

    def commit(self, chunks: ChunkTable | Iterable[Chunk], metadata: dict) -> str:
        """Check and encode the manifest, create it (never overwriting one), move LATEST by
        compare-and-swap; returns the committed checkpoint's URL."""
        return self.commit_manifest(self.manifest(chunks, metadata))

    def commit_manifest(self, manifest: bytes) -> str:
        """The second half of `commit`, for a writer that encodes on one thread and commits on
        another (async saves: cluster/run/async_save.py)."""
        return self.store.commit(self.run, self.step, manifest)
