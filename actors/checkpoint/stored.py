"""A committed checkpoint opened for reading, and the verification of chunks read in parts.

Layout-free: a read names global regions (`Target`), and only the byte ranges of stored chunks
that overlap them are fetched, so any layout can read what any other layout wrote.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import fsspec
import torch

from rayshard.storage.manifest_io import read_manifest
from rayshard.storage.partial_reads import PartialRead, check_partial_reads, mismatch_error
from rayshard.storage.backends.registry import backend_for
from rayshard.actors.checkpoint.read_executor import WINDOW_BYTES, Destination, execute_requests
from rayshard.plans.checkpoint.chunk_table import ChunkTable, as_table
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.manifest.object_keys import check_object_keys
from rayshard.plans.checkpoint.reshard import (OBJECT_STORE_MIN_SEGMENT_BYTES, ReadItem, Target, header_checks,
                                              index_chunks, plan_rank)


class StoredCheckpoint:
    """A committed checkpoint opened for reading: its chunks indexed once, then any number of
    planned reads. The one read path shared by training loads, the offline reshard, the digest
    and the exporters."""

    def __init__(self, url: str, chunks: ChunkTable | list[Chunk] | None = None, metadata: dict | None = None,
                 keys_checked: bool = False):
        """keys_checked: the chunks came from `read_manifest` (which checks their object keys)."""
        if chunks is None:
            chunks, metadata = read_manifest(url)
        chunks = as_table(chunks)  # columns: records are made only for the chunks a read touches
        if not keys_checked:  # chunks decoded elsewhere get the same check as read_manifest's
            check_object_keys(chunks.file_names(), url)
        self.url, self.chunks, self.metadata = url, chunks, metadata or {}
        self.partial_reads: list[PartialRead] = []  # parts of chunks read and not yet verified
        self.index = index_chunks(chunks)
        # Header ranges come from all of a file's chunks (everything before its first one).
        self.headers = header_checks(chunks)
        self.fs, self.base = fsspec.core.url_to_fs(url)

    def tensors(self) -> dict[tuple[str, str], list[Chunk]]:
        return {key: index.chunks for key, index in self.index.items()}

    def plan(self, targets, window_bytes: int = WINDOW_BYTES):
        # Requests up to the whole window: fewer, larger GETs measured faster on the S3 server we
        # test against, which reads a whole object for every ranged GET (docs/decisions.md 35).
        return plan_rank(self.index, list(targets), headers=self.headers, max_request_bytes=window_bytes,
                         min_segment_bytes=min_segment_bytes_for(self.fs))

    def read(self, destinations: dict[Target, Destination], window_bytes: int = WINDOW_BYTES,
             groups: dict[Target, int] | None = None, group_done: Callable[[int], None] | None = None) -> dict:
        """Plan and execute the reads that fill every target (name, kind, region) into its tensor.

        groups: target -> group number; the groups' reads go first, lowest number first, and
        group_done(number) is called as soon as every target of that group is verified and in
        place (a read-once load hands a group to its replicas while it reads the next)."""
        plan = self.plan(destinations, window_bytes)
        by_item = {item: destinations[target] for target, items in plan.items.items() for item in items}
        requests, served = plan.requests, None
        if groups:
            requests, served = _group_order(plan, groups, group_done)
        bytes_read = execute_requests(self.fs, self.base, requests, by_item, window_bytes, served, self.partial_reads)
        return {"bytes_read": bytes_read, "bytes_needed": plan.bytes_needed, "requests": len(plan.requests),
                "files": plan.files}

    def take_partial_reads(self) -> list[PartialRead]:
        """The parts of chunks read since the last call, to verify where all of a chunk's parts
        meet (`check_partial_reads`)."""
        reads, self.partial_reads = self.partial_reads, []
        return reads

    def check_partial_reads(self) -> int:
        """Verify the chunks this process read in parts (`verify_parts`)."""
        return verify_parts(self.take_partial_reads(), self.url, lambda: self)

    def read_chunk_whole(self, part: PartialRead) -> None:
        """Read the chunk a part belongs to whole, which checks its checksum as it lands."""
        tensor = self.index[(part.name, part.kind)]
        rows = tensor.rows[(self.chunks.byte_start[tensor.rows] == part.chunk_start)
                           & (self.chunks.codes["file"][tensor.rows] == self.chunks.code("file", part.file))]
        chunk = self.chunks.chunks_at(rows[:1])[0]
        self.read_region(chunk.name, chunk.kind, chunk.offsets, chunk.sizes)

    def read_region(self, name: str, kind: str, offsets: tuple, sizes: tuple) -> torch.Tensor:
        """A fresh CPU tensor holding one region of one stored tensor."""
        chunk = self.index[(name, kind)].chunks[0]
        tensor = torch.empty(sizes, dtype=getattr(torch, chunk.dtype))
        self.read({Target(name, kind, tuple(offsets), tuple(sizes)): Destination(tensor, tuple(offsets))})
        return tensor


def _group_order(plan, groups: dict[Target, int], group_done: Callable[[int], None]):
    """The plan's requests with the groups' first (lowest group first), and the per-item
    callback that reports each group once all of its targets are in place."""
    target_of = {item: target for target, items in plan.items.items() for item in items}
    items_left = {target: len(items) for target, items in plan.items.items()}
    targets_left = Counter(groups[target] for target in plan.items if target in groups)
    after_groups = max(groups.values(), default=0) + 1

    def order(request) -> int:
        return min((groups.get(target_of[part], after_groups) for part in request.parts if isinstance(part, ReadItem)),
                   default=-1)  # header-only requests first: they are small

    def served(item) -> None:
        target = target_of[item]
        items_left[target] -= 1
        if items_left[target] == 0 and target in groups:
            group = groups[target]
            targets_left[group] -= 1
            if targets_left[group] == 0:
                group_done(group)

    return sorted(plan.requests, key=order), served


def verify_parts(reads: list[PartialRead], checkpoint_url: str, opened: Callable[[], StoredCheckpoint]) -> int:
    """Verify chunks read in parts, by one process or gathered from every rank that read some: the
    parts of each chunk combine to its checksum. A chunk whose parts do not cover it exactly (a
    rank's read failed or was skipped) is read whole, from `opened()`. Raises a CheckpointError
    naming every chunk that fails; returns how many chunks were verified."""
    outcome = check_partial_reads(reads)
    if outcome.mismatched:
        raise mismatch_error(outcome.mismatched, checkpoint_url)
    if outcome.untiled:
        stored = opened()
        for part in outcome.untiled:
            stored.read_chunk_whole(part)
    return outcome.verified + len(outcome.untiled)


def check_loaded_parts(checkpoint_url: str, results: list[dict], manifest: bytes | None = None) -> int:
    """After every rank of a load returned: verify the chunks they read in parts, together. The
    checkpoint is opened (its manifest decoded) only if some chunk must be read whole."""
    reads = [read for result in results for read in result.get("partial_reads", ())]
    return verify_parts(reads, checkpoint_url,
                        lambda: StoredCheckpoint(checkpoint_url, *read_manifest(checkpoint_url, manifest), keys_checked=True))


def min_segment_bytes_for(fs) -> int:
    """A column slice of a stored chunk is read as exact row segments where short ranges are
    cheap (local files: a pread each, 1.0x the bytes, decision 114; the snapshot keepers: one call
    per file, decision 218); from an object store, where every segment would be its own ranged
    GET (300k of them for a 135M model at tp3), segments shorter than
    OBJECT_STORE_MIN_SEGMENT_BYTES are read as whole rows instead: fewer requests, more bytes."""
    return 0 if backend_for(fs).short_ranges_are_cheap else OBJECT_STORE_MIN_SEGMENT_BYTES
