"""Every target rank's reads at once, column-wise: the plan a dry run (`ckpt plan`) prints.

`plan_rank` makes a `ReadItem` per overlap and a `Request` per coalesced range: what one rank
executes at load time. Over 12,288 target ranks of a 405B model that is ~2M records of each, made
only to be summed: 30 s and most of a 2 GiB driver. Here the same geometry runs on numpy columns
over a batch of ranks at once: each target's candidate chunks by interval search on dim 0 (the
rows `TableTensor` searches), the overlap boxes, the byte ranges `_items_for_overlap` would cut
(whole rows, or one range per row for a column split: `reads_by_row`), the
header checks of files read in part, and `coalesce`'s merge of touching ranges per (rank, file).
What comes out is per-rank totals; `LayoutPlan.ranks[r]` runs `plan_rank` itself for the ranks a
caller looks at, and tests hold the totals to `plan_rank`'s on many layouts.

The coverage proof is the same: the source chunks tile every tensor (`check_chunks_disjoint_and_
complete`), and every target region read from storage is covered by overlaps whose volumes sum
to its own. A batch with a failing target re-plans the first failing rank with `plan_rank`,
which raises, so the verdict and the message are that function's.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rayshard.plans.checkpoint.chunk_table import ChunkTable, FileHeaders, as_table
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.reshard import (DEFAULT_MIN_SEGMENT_BYTES, ChunkIndex, RankReadPlan, Target,
                                      check_chunks_disjoint_and_complete, header_checks, index_chunks, plan_rank,
                                      reads_by_row)
from rayshard.plans.checkpoint.safetensors_layout import ITEMSIZE
from rayshard.plans.checkpoint.target_table import READS_ITSELF, TargetTable
from rayshard.plans.errors import CheckpointError

# Targets planned per batch: bounds the candidate-pair columns (~100 bytes a pair, ~7 pairs a
# target at 16k ranks) to ~100 MiB whatever the layout.
BATCH_TARGETS = 1 << 17


class RankPlans(Sequence):
    """Rank r's `RankReadPlan`, made by `plan_rank` when asked for (and kept)."""

    def __init__(self, index: ChunkIndex, headers, targets: TargetTable, min_segment_bytes: int):
        self._index, self._headers, self._targets = index, headers, targets
        self._min_segment_bytes = min_segment_bytes
        self._cache: dict = {}  # per-region read items, shared by replicas (plan_rank's cache)
        self._made: dict[int, RankReadPlan] = {}

    def __len__(self) -> int:
        return self._targets.world_size

    def __getitem__(self, rank):
        if isinstance(rank, slice):
            return [self[r] for r in range(len(self))[rank]]
        if rank < 0:
            rank += len(self)
        if not 0 <= rank < len(self):
            raise IndexError(rank)
        made = self._made.get(rank)
        if made is None:
            made = self._made[rank] = plan_rank(self._index, self._targets.targets_of(rank), rank, self._headers,
                                                self._min_segment_bytes, cache=self._cache)
        return made


@dataclass(frozen=True)
class TensorReads:
    """One stored tensor's (name, kind) bytes read and bytes needed by a whole layout's load."""

    read: int
    needed: int


@dataclass
class LayoutPlan:
    """Every target rank's reads as per-rank totals (int64 arrays indexed by rank), with the
    proof and the sums a dry run prints; `ranks[r]` is rank r's full plan, made on demand."""

    ranks: RankPlans
    regions: int
    source_bytes: int
    rank_bytes_read: np.ndarray
    rank_bytes_needed: np.ndarray
    rank_bytes_received: np.ndarray
    rank_requests: np.ndarray
    rank_files: np.ndarray
    rank_pieces: np.ndarray = field(default=None)
    # (name, kind) -> bytes its read items span and bytes its targets need, over every rank
    tensors: dict[tuple[str, str], "TensorReads"] = field(default_factory=dict)

    def amplification_by(self, group: Callable[[str, str], str]) -> dict[str, tuple[int, int]]:
        """group(name, kind) -> (bytes read, bytes needed) summed over its tensors, in first-seen
        order. Bytes read per tensor are its items' before coalescing (a request may serve several
        tensors; the file header checks belong to none), so they sum to about `bytes_read`."""
        sums: dict[str, list[int]] = {}
        for (name, kind), reads in self.tensors.items():
            found = sums.setdefault(group(name, kind), [0, 0])
            found[0] += reads.read
            found[1] += reads.needed
        return {key: (read, needed) for key, (read, needed) in sums.items()}

    @property
    def bytes_read(self) -> int:
        return int(self.rank_bytes_read.sum())

    @property
    def bytes_needed(self) -> int:
        return int(self.rank_bytes_needed.sum())

    @property
    def requests(self) -> int:
        return int(self.rank_requests.sum())

    @property
    def bytes_received(self) -> int:
        return int(self.rank_bytes_received.sum())

    def proof(self) -> str:
        return (f"coverage proven: source chunks tile every tensor without overlap, and each of the "
                f"{self.regions} target regions is covered by overlaps whose volumes sum to its own: "
                f"every target element is read exactly once")


def plan_layout(chunks: Sequence[Chunk], targets: TargetTable | Sequence[Sequence[Target]],
                min_segment_bytes: int = DEFAULT_MIN_SEGMENT_BYTES, check_sources: bool = True,
                batch_targets: int = BATCH_TARGETS) -> LayoutPlan:
    """Plan every target rank of a layout (targets from `rayshard.plans.checkpoint.regions`: a
    `TargetTable`, or per-rank `Target` lists)."""
    table = as_table(chunks)
    if check_sources:
        check_chunks_disjoint_and_complete(table)
    wanted = targets if isinstance(targets, TargetTable) else TargetTable.from_lists(targets)
    headers = header_checks(table)
    ranks = RankPlans(index_chunks(table), headers, wanted, min_segment_bytes)
    world = wanted.world_size
    totals = {name: np.zeros(world, np.int64) for name in ("read", "needed", "requests", "files", "received", "pieces")}
    tensors = len(table.values["name"]) * max(1, len(table.values["kind"]))  # table.tensor_keys()' range
    totals["tensor_read"], totals["tensor_needed"] = np.zeros(tensors, np.int64), np.zeros(tensors, np.int64)
    volumes = wanted.volumes()
    received = wanted.receive_from != READS_ITSELF
    np.add.at(totals["received"], wanted.rank[received], volumes[received] * wanted.itemsize[received])
    totals["pieces"] = np.bincount(wanted.rank, minlength=world).astype(np.int64)
    if len(wanted):
        sources = _SourceRows(table, headers)
        bounds = wanted.rank_bounds()
        low_rank = 0
        while low_rank < world:  # batches of whole ranks: requests coalesce within a rank
            high_rank = int(np.searchsorted(bounds, bounds[low_rank] + batch_targets, "right")) - 1
            high_rank = min(world, max(high_rank, low_rank + 1))
            rows = np.arange(bounds[low_rank], bounds[high_rank])
            failing = _plan_batch(sources, wanted, rows, volumes, min_segment_bytes, totals)
            if failing is not None:
                ranks[failing]  # raises plan_rank's own error for the first failing rank
                raise CheckpointError(f"target rank {failing}: the column-wise planner found a coverage failure "
                                      "that plan_rank does not; report this as a rayshard bug")
            low_rank = high_rank
    return LayoutPlan(ranks, len(wanted), table.total_bytes(), totals["read"], totals["needed"], totals["received"],
                      totals["requests"], totals["files"], totals["pieces"],
                      _by_tensor(table, totals["tensor_read"], totals["tensor_needed"]))


def _by_tensor(table: ChunkTable, read: np.ndarray, needed: np.ndarray) -> dict[tuple[str, str], TensorReads]:
    names, kinds = table.values["name"], table.values["kind"]
    width = max(1, len(kinds))
    return {(names[key // width], kinds[key % width]): TensorReads(int(read[key]), int(needed[key]))
            for key in np.flatnonzero(needed | read).tolist()}


class _SourceRows:
    """The source rows in `TableTensor`'s order (by tensor, then dim-0 offset), with one sorted
    int64 key per row (tensor segment, dim-0 start) so one `np.searchsorted` finds every target's
    candidates: the rows whose dim-0 start lies in (target start - tensor's tallest chunk,
    target end), as `TableTensor.overlapping` finds them."""

    def __init__(self, table: ChunkTable, headers: FileHeaders):
        self.table = table
        keys = table.tensor_keys()
        starts = np.where(table.ndim > 0, table.boxes["offsets"][:, 0], 0)
        self.order = np.lexsort((starts, keys))
        sorted_keys = keys[self.order]
        self.tensor_keys, segment_starts = np.unique(sorted_keys, return_index=True)
        self.segment_low = segment_starts
        self.segment_high = np.r_[segment_starts[1:], len(sorted_keys)]
        segment = np.repeat(np.arange(len(self.tensor_keys)), self.segment_high - self.segment_low)
        heights = np.where(table.ndim > 0, table.boxes["sizes"][:, 0], 1)[self.order]
        self.tallest = np.zeros(len(self.tensor_keys), np.int64)
        if len(heights):
            np.maximum.at(self.tallest, segment, heights)
        self.max_start = int(starts.max()) if len(starts) else 0
        self.span = self.max_start + 3  # keys of one segment lie in (segment * span, (segment + 1) * span)
        self.sorted_key = segment * self.span + starts[self.order] + 1
        itemsizes = np.array([ITEMSIZE.get(dtype, 0) for dtype in table.values["dtype"]] or [0], np.int64)
        self.itemsize = itemsizes[table.codes["dtype"]]
        self.kinds = max(1, len(table.values["kind"]))
        # Per file code: where its header check ends (its first chunk's start), -1 without a header.
        self.header_end = headers.first_chunk_starts()

    def segments(self, targets: TargetTable, rows: np.ndarray) -> np.ndarray:
        """Each target row's tensor segment (-1: the checkpoint does not hold that tensor)."""
        name_map = np.array([self.table.code("name", n) if self.table.code("name", n) is not None else -1
                             for n in targets.names] or [-1], np.int64)
        kind_map = np.array([self.table.code("kind", k) if self.table.code("kind", k) is not None else -1
                             for k in targets.kinds] or [-1], np.int64)
        names, kinds = name_map[targets.name_code[rows]], kind_map[targets.kind_code[rows]]
        keys = names * self.kinds + kinds
        found = np.searchsorted(self.tensor_keys, keys)
        found = np.minimum(found, max(0, len(self.tensor_keys) - 1))
        present = (names >= 0) & (kinds >= 0) & (len(self.tensor_keys) > 0)
        present &= self.tensor_keys[found] == keys if len(self.tensor_keys) else False
        return np.where(present, found, -1)

    def candidates(self, segment: np.ndarray, ndim: np.ndarray, start: np.ndarray,
                   end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """[low, high) positions (in `order`) of each target's candidate rows."""
        base = segment * self.span
        low_value = base + np.maximum(start - self.tallest[segment], -1) + 1
        high_value = base + np.minimum(end, self.max_start + 1) + 1
        low = np.searchsorted(self.sorted_key, low_value, "right")
        high = np.searchsorted(self.sorted_key, high_value, "left")
        whole = ndim == 0  # a 0-d region takes every chunk of its tensor
        low = np.where(whole, self.segment_low[segment], low)
        high = np.where(whole, self.segment_high[segment], high)
        return low, np.maximum(low, high)


def _plan_batch(sources: _SourceRows, targets: TargetTable, rows: np.ndarray, volumes: np.ndarray,
                min_segment_bytes: int, totals: dict) -> int | None:
    """Add these target rows' reads to the per-rank totals; the first rank with a failing target
    (not held, rank mismatch, not covered), or None."""
    table = sources.table
    reads = rows[targets.receive_from[rows] == READS_ITSELF]
    segment = sources.segments(targets, reads)
    missing_ranks = targets.rank[reads[segment < 0]]
    planned = (segment >= 0) & (volumes[reads] > 0)  # an empty region reads nothing (plan_reads returns [])
    reads, segment = reads[planned], segment[planned]
    ndim = targets.ndim[reads]
    t_off, t_size = targets.offsets[reads], targets.sizes[reads]
    low, high = sources.candidates(segment, ndim, t_off[:, 0], t_off[:, 0] + t_size[:, 0])
    counts = high - low
    pair_target = np.repeat(np.arange(len(reads)), counts)
    first_pair = np.cumsum(counts) - counts
    chunk = sources.order[low[pair_target] + np.arange(len(pair_target)) - first_pair[pair_target]]
    # A candidate of another rank fails the region (plan_reads raises on it, overlapping or not).
    mismatch = table.dims["offsets"][chunk] != ndim[pair_target]
    width = max(table.width, targets.width)
    c_off, c_size = _widen(table.boxes["offsets"][chunk], width), _widen(table.boxes["sizes"][chunk], width)
    p_off, p_size = _widen(t_off, width)[pair_target], _widen(t_size, width)[pair_target]
    used = np.arange(width) < ndim[pair_target][:, None]
    lo = np.maximum(c_off, p_off)
    hi = np.minimum(c_off + c_size, p_off + p_size)
    del p_off, p_size
    overlaps = ~mismatch & ~((hi <= lo) & used).any(axis=1)
    extent = np.where(used, hi - lo, 1)
    volume = np.where(overlaps, extent.prod(axis=1), 0)
    covered = np.r_[0, np.cumsum(volume)]
    covered = covered[first_pair + counts] - covered[first_pair]
    itemsize = sources.itemsize[chunk]
    failed = (covered != volumes[reads]) | (np.bincount(pair_target, mismatch, len(reads)) > 0)
    failed |= np.bincount(pair_target, overlaps & (itemsize == 0), len(reads)) > 0  # a dtype plan_rank cannot size
    bad = np.r_[missing_ranks, targets.rank[reads[failed]]]
    if len(bad):
        return int(bad.min())
    keep = np.flatnonzero(overlaps)
    rank = targets.rank[reads][pair_target[keep]]
    np.add.at(totals["needed"], rank, volume[keep] * itemsize[keep])
    tensor = table.tensor_keys()[chunk[keep]]
    np.add.at(totals["tensor_needed"], tensor, volume[keep] * itemsize[keep])
    items = _byte_ranges(table, chunk[keep], c_off[keep], c_size[keep], lo[keep], extent[keep], itemsize[keep],
                         ndim[pair_target[keep]], rank, min_segment_bytes)
    np.add.at(totals["tensor_read"], table.tensor_keys()[items.chunk], items.end - items.start)
    _add_requests(sources, items, totals)
    return None


def _widen(box: np.ndarray, width: int) -> np.ndarray:
    return box if box.shape[1] == width else np.pad(box, ((0, 0), (0, width - box.shape[1])))


@dataclass
class _Items:
    """Read items as columns: the byte range, its rank and file, and whether it is a whole chunk."""

    rank: np.ndarray
    file: np.ndarray
    start: np.ndarray
    end: np.ndarray
    whole: np.ndarray
    chunk: np.ndarray  # the source row each range reads


def _byte_ranges(table: ChunkTable, chunk, c_off, c_size, lo, extent, itemsize, ndim, rank,
                 min_segment_bytes: int) -> _Items:
    """`_items_for_overlap` over every overlap at once."""
    width = c_off.shape[1]
    column = np.arange(width)
    byte_start, byte_end = table.byte_start[chunk], table.byte_end[chunk]
    row_elements = np.where((column >= 1) & (column < ndim[:, None]), c_size, 1).prod(axis=1)
    column_elements = np.where((column >= 2) & (column < ndim[:, None]), c_size, 1).prod(axis=1)
    row_bytes = row_elements * itemsize
    first_row = lo[:, 0] - c_off[:, 0]
    same = (extent == c_size) | (column >= ndim[:, None])
    full_rows = same[:, 1:].all(axis=1)
    tail_same = same[:, 2:].all(axis=1)
    segment_bytes = (extent[:, 1] if width > 1 else np.ones(len(chunk), np.int64)) * column_elements * itemsize
    by_row = ~full_rows & (ndim >= 2) & tail_same & (segment_bytes >= min_segment_bytes) & reads_by_row(row_bytes, segment_bytes)
    scalar = ndim == 0
    # Whole rows: one range per overlap (a 0-d tensor: its chunk).
    whole_rows = ~by_row
    start = np.where(scalar, byte_start, byte_start + first_row * row_bytes)[whole_rows]
    end = np.where(scalar, byte_end, byte_start + (first_row + extent[:, 0]) * row_bytes)[whole_rows]
    item_rank, item_chunk = rank[whole_rows], chunk[whole_rows]
    # A column split whose row segments are long enough: one range per row.
    split = np.flatnonzero(by_row)
    if len(split):
        repeats = extent[split, 0]
        which = np.repeat(split, repeats)
        row = first_row[which] + np.arange(len(which)) - np.repeat(np.cumsum(repeats) - repeats, repeats)
        first_column = lo[which, 1] - c_off[which, 1]
        row_start = byte_start[which] + row * row_bytes[which] + first_column * column_elements[which] * itemsize[which]
        start, end = np.r_[start, row_start], np.r_[end, row_start + segment_bytes[which]]
        item_rank, item_chunk = np.r_[item_rank, rank[which]], np.r_[item_chunk, chunk[which]]
    whole = (start == table.byte_start[item_chunk]) & (end == table.byte_end[item_chunk])
    return _Items(item_rank, table.codes["file"][item_chunk].astype(np.int64), start, end, whole, item_chunk)


def _add_requests(sources: _SourceRows, items: _Items, totals: dict) -> None:
    """`plan_rank`'s header checks and `coalesce` (no request size limit) for every rank of the
    batch: per (rank, file), ranges in (start, end) order merge while they touch."""
    files = len(sources.header_end)
    # A file read in part is checked by its header, [0, its first chunk), where the manifest records one.
    partly = np.unique(items.rank[~items.whole] * files + items.file[~items.whole])
    partly = partly[sources.header_end[partly % files] >= 0]
    group = np.r_[items.rank * files + items.file, partly]
    start = np.r_[items.start, np.zeros(len(partly), np.int64)]
    end = np.r_[items.end, sources.header_end[partly % files]]
    order = np.lexsort((end, start, group))
    group, start, end = group[order], start[order], end[order]
    new_group = np.r_[True, group[1:] != group[:-1]]
    group_first = np.flatnonzero(new_group)
    group_of = np.cumsum(new_group) - 1
    # Each group moved onto its own stretch of one number line (a gap of 1 between groups), so a
    # running maximum of ends never carries from one group into the next.
    group_min = start[group_first]
    span = np.maximum.reduceat(end, group_first) - group_min + 1
    if float(span.astype(np.float64).sum()) >= 2.0**62:
        raise OverflowError("a batch of ranks spans more bytes than int64 holds; plan with a smaller batch_targets")
    base = (np.cumsum(span) - span - group_min)[group_of]
    shifted_end = end + base
    reach = np.maximum.accumulate(shifted_end)
    opens = np.r_[True, start[1:] + base[1:] > reach[:-1]]
    request_first = np.flatnonzero(opens)
    request_bytes = np.maximum.reduceat(shifted_end, request_first) - base[request_first] - start[request_first]
    request_rank = group[request_first] // files
    np.add.at(totals["read"], request_rank, request_bytes)
    np.add.at(totals["requests"], request_rank, 1)
    np.add.at(totals["files"], group[group_first] // files, 1)
