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
from rayshard.plans.errors import CheckpointError


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

    def check_files_written(self, chunks: ChunkTable | Iterable[Chunk]) -> None:
        """Every file the manifest names exists and reaches its last chunk's end, read from one
        listing per directory (all of a save's files share its attempt folder). A writer's own
        close says its file is whole; what this catches is a file gone since: `ckpt gc` removing
        an attempt it took for a leftover while a slow rank was still uploading into it (an
        upload in flight is invisible to its listing), which the commit then named in a manifest
        LATEST points at (decision 227). `commit` runs it; a writer that encodes on one thread and
        commits on another runs it on the committing one (a listing, kept off a training loop)."""
        needed = (chunks if isinstance(chunks, ChunkTable) else ChunkTable.from_chunks(list(chunks))).file_extents()
        if not needed:
            return
        fs, checkpoint = self.store.fs, self.store.checkpoint_path(self.run, self.step)
        place = {file: tuple(f"{checkpoint}/{file}".rsplit("/", 1)) for file in needed}  # file -> (directory, name)
        sizes: dict[tuple[str, str], int] = {}
        for directory in sorted({where for where, _ in place.values()}):
            fs.invalidate_cache(directory)  # s3fs keeps listings: one from before the writes would miss them
            try:
                listing = fs.ls(directory, detail=True)
            except FileNotFoundError:
                listing = []
            sizes.update({(directory, entry["name"].rstrip("/").rsplit("/", 1)[-1]): int(entry.get("size") or 0)
                          for entry in listing if entry.get("type") != "directory"})
        short = []
        for file, end in needed.items():
            size = sizes.get(place[file])
            if size is None or size < end:
                short.append(f"{file} ({'missing' if size is None else f'{size:,} of {end:,} bytes'})")
        if short:
            raise CheckpointError(f"{self.run}@{self.step}: not committed: {len(short)} file(s) it would name are not there "
                                  f"whole: {', '.join(short[:3])}{' ...' if len(short) > 3 else ''}; removed after they were "
                                  "written (a `ckpt gc` run while a rank was still writing takes its attempt for a "
                                  "leftover). Fix: save again, and run gc with a --grace longer than a save takes")

    def commit(self, chunks: ChunkTable | Iterable[Chunk], metadata: dict) -> str:
        """Check and encode the manifest, check its files are there whole, create it (never
        overwriting one), move LATEST by compare-and-swap; returns the committed checkpoint's URL."""
        chunks = chunks if isinstance(chunks, ChunkTable) else list(chunks)
        manifest = self.manifest(chunks, metadata)
        self.check_files_written(chunks)
        return self.commit_manifest(manifest)

    def commit_manifest(self, manifest: bytes) -> str:
        """The second half of `commit`, for a writer that encodes on one thread and commits on
        another (async saves: cluster/run/async_save.py)."""
        return self.store.commit(self.run, self.step, manifest)
