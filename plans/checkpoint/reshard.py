"""The reshard planner: which bytes each target rank reads to fill its pieces from a checkpoint.

Pure geometry over chunk metadata, no I/O and no process groups, so the same plan is printed by a
dry run (`rayshard ckpt plan`), executed by every rank at load time (each plans only its own
pieces), and executed by the offline `rayshard ckpt reshard`. A dry run over a whole layout runs
this geometry column-wise over every rank at once (`plans/checkpoint/layout_plan.py`).

For one target region and one stored chunk of the same tensor the overlap is a box. Chunks are
row-major, so a box that spans the chunk's full extent past dim 0 is one contiguous byte range
(whole rows). A box that spans only some columns (a row-parallel weight read at another tp
degree, or by fsdp rows of a tp chunk) is read as one exact range per row, unless the rest of the
row is small next to the segment (at most 1/OVERREAD_DENOMINATOR of it): then as whole rows, one
range that reads at most 5% more. Reading whole rows whenever the segments were short (the old
rule, below 256 KiB) made every tp3 rank read a tp2 or fsdp checkpoint's `wo` and `down` whole:
1.54x the bytes held on the 135M model (docs/decisions.md 114). A caller that prefers fewer,
larger requests to exact bytes (a request-priced store) may still ask for whole rows below
`min_segment_bytes`. Items in the same file whose byte ranges touch are then coalesced into one
request. Parts of a chunk read by several ranks are verified together (`storage/partial_reads.py`).

Coverage is proven, not assumed: a tensor's chunks are checked to tile it without overlap
(`check_chunks_disjoint_and_complete`, a sweep, not all pairs), and for every target region the
overlaps' volumes must add up to the region's volume; over disjoint chunks that means every
target element is read exactly once.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from rayshard.plans.checkpoint.chunk_table import ChunkTable, FileHeaders, as_table
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.expert_coverage import expert_note
from rayshard.plans.errors import CheckpointError

DEFAULT_MIN_SEGMENT_BYTES = 0  # exact row segments however short (issue 42): amplification over request count
# On object stores each row segment is a ranged GET: shorter segments are read as whole rows there
# (actors/checkpoint/stored.py min_segment_bytes_for; decision 114).
OBJECT_STORE_MIN_SEGMENT_BYTES = 256 * 1024
# A column split is read as whole rows when the rest of each row is at most 1/20 of the segment
# (<= 1.05x the bytes needed), as exact row segments otherwise.
OVERREAD_DENOMINATOR = 20


@dataclass(frozen=True)
class ReadItem:
    """One contiguous byte range of one chunk and the part of the target region it supplies."""

    chunk: Chunk
    byte_start: int  # absolute, within chunk.file
    byte_end: int
    held_offsets: tuple[int, ...]  # the global box these bytes hold, row-major
    held_sizes: tuple[int, ...]
    offsets: tuple[int, ...]  # the global box the target needs from them (inside the held box)
    sizes: tuple[int, ...]

    @property
    def file(self) -> str:
        return self.chunk.file

    @property
    def nbytes(self) -> int:
        return self.byte_end - self.byte_start

    @property
    def needed_bytes(self) -> int:
        return _volume(self.sizes) * self.chunk.itemsize

    @property
    def whole_chunk(self) -> bool:
        """Reads all of its chunk, so the chunk's checksum can be verified."""
        return (self.byte_start, self.byte_end) == (self.chunk.byte_start, self.chunk.byte_end)


def _volume(sizes: Iterable[int]) -> int:
    count = 1
    for size in sizes:
        count *= size
    return count


def _intersect(a_off, a_size, b_off, b_size):
    offsets, sizes = [], []
    for ao, asz, bo, bsz in zip(a_off, a_size, b_off, b_size):
        lo, hi = max(ao, bo), min(ao + asz, bo + bsz)
        if hi <= lo:
            return None
        offsets.append(lo)
        sizes.append(hi - lo)
    return tuple(offsets), tuple(sizes)


class TensorChunks:
    """One tensor's chunks, indexed by dim-0 start so a region finds its overlaps by bisection
    (a 1024-way FSDP tensor has 1024 chunks; scanning them all per region is quadratic)."""

    def __init__(self, chunks: Sequence[Chunk]):
        self.chunks = sorted(chunks, key=lambda c: (c.offsets, c.file, c.byte_start))
        self.starts = [c.offsets[0] if c.offsets else 0 for c in self.chunks]
        self.longest = max((c.sizes[0] if c.sizes else 1 for c in self.chunks), default=0)
        self.rank = len(self.chunks[0].offsets) if self.chunks else None  # the stored tensor's

    def overlapping(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[Chunk]:
        if not offsets:
            return list(self.chunks)
        low = bisect.bisect_right(self.starts, offsets[0] - self.longest)
        high = bisect.bisect_left(self.starts, offsets[0] + sizes[0])
        return self.chunks[low:high]


class TableTensor:
    """One tensor's rows of a `ChunkTable`, in the order `TensorChunks` keeps (offsets, file,
    byte start): an interval search on dim 0 (np.searchsorted) finds a region's overlaps, and
    `Chunk` records are made only for those."""

    def __init__(self, table: ChunkTable, rows: np.ndarray):
        offsets = table.boxes["offsets"][rows]
        order = np.lexsort([table.byte_start[rows], table.codes["file"][rows]]
                           + [offsets[:, d] for d in reversed(range(offsets.shape[1]))])
        self.table, self.rows = table, rows[order]
        self.starts = np.where(table.ndim[self.rows] > 0, offsets[order, 0], 0)
        heights = np.where(table.ndim[self.rows] > 0, table.boxes["sizes"][self.rows, 0], 1)
        self.longest = int(heights.max()) if len(heights) else 0
        self.rank = int(table.ndim[self.rows[0]]) if len(self.rows) else None  # the stored tensor's

    @property
    def chunks(self) -> list[Chunk]:
        return self.table.chunks_at(self.rows)

    def overlapping(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> list[Chunk]:
        if not offsets:
            return self.chunks
        low = int(np.searchsorted(self.starts, offsets[0] - self.longest, "right"))
        high = int(np.searchsorted(self.starts, offsets[0] + sizes[0], "left"))
        return self.table.chunks_at(self.rows[low:high])


class ChunkIndex(Mapping):
    """(name, kind) -> `TableTensor`, over a `ChunkTable`: one sort of the rows by tensor, then
    each tensor's rows ordered when first asked for (a rank asks for the few it holds)."""

    def __init__(self, table: ChunkTable):
        self.table = table
        keys = table.tensor_keys()
        narrow = np.uint16 if len(keys) and keys.max() < 2**16 else np.int64  # uint16: numpy's radix sort
        keys = keys.astype(narrow)
        self._order = np.argsort(keys, kind="stable")
        self._sorted = keys[self._order]
        self._kinds = max(1, len(table.values["kind"]))
        self._tensors: dict[tuple[str, str], TableTensor] = {}
        self._keys: list[tuple[str, str]] | None = None

    def __getitem__(self, key: tuple[str, str]) -> TableTensor:
        found = self._tensors.get(key)
        if found is None:
            name, kind = self.table.code("name", key[0]), self.table.code("kind", key[1])
            if name is None or kind is None:
                raise KeyError(key)
            code = name * self._kinds + kind
            low, high = np.searchsorted(self._sorted, code, "left"), np.searchsorted(self._sorted, code, "right")
            if low == high:
                raise KeyError(key)
            found = self._tensors[key] = TableTensor(self.table, self._order[low:high])
        return found

    def _all_keys(self) -> list[tuple[str, str]]:
        if self._keys is None:
            keys, first = np.unique(self._sorted, return_index=True)
            by_row = np.argsort(self._order[first])  # first-listed order, as a dict built row by row
            names, kinds = self.table.values["name"], self.table.values["kind"]
            self._keys = [(names[int(k) // self._kinds], kinds[int(k) % self._kinds]) for k in keys[by_row].tolist()]
        return self._keys

    def __iter__(self):
        return iter(self._all_keys())

    def __len__(self) -> int:
        return len(self._all_keys())


def plan_reads(chunks: Sequence[Chunk] | TensorChunks, offsets: tuple[int, ...], sizes: tuple[int, ...],
               what: str = "", min_segment_bytes: int = DEFAULT_MIN_SEGMENT_BYTES) -> list[ReadItem]:
    """Read items that exactly cover the region (offsets, sizes). Raises if coverage fails."""
    target_volume = _volume(sizes)
    if target_volume == 0:
        return []
    index = chunks if isinstance(chunks, (TensorChunks, TableTensor)) else TensorChunks(chunks)
    # Before the overlap search, which reads dim 0 only: a region of another rank would otherwise
    # get this error or a "covers 0 of" one depending on where its dim 0 falls.
    if index.rank is not None and index.rank != len(offsets):
        raise CheckpointError(f"{what}: stored rank {index.rank} differs from target rank {len(offsets)}")
    items: list[ReadItem] = []
    covered = 0
    for chunk in index.overlapping(offsets, sizes):
        if len(chunk.offsets) != len(offsets):  # a damaged list whose chunks disagree on the rank
            raise CheckpointError(f"{what}: stored rank {len(chunk.offsets)} differs from target rank {len(offsets)}")
        overlap = _intersect(chunk.offsets, chunk.sizes, offsets, sizes)
        if overlap is None:
            continue
        covered += _volume(overlap[1])
        items += _items_for_overlap(chunk, *overlap, min_segment_bytes)
    if covered != target_volume:
        # Chunks of one tensor never overlap (checked on save), so a volume mismatch means gaps.
        found = list(index.overlapping(offsets, sizes))
        some = found[0] if found else next(iter(index.overlapping((0,) * len(offsets), (1 << 62,) * len(offsets))), None)
        note = expert_note(some.name, some.global_shape, found, (offsets, sizes)) if some is not None else ""
        raise CheckpointError(
            f"{what}: the checkpoint's chunks cover {covered} of the {target_volume} elements needed "
            f"for region offsets={offsets} sizes={sizes}{note}; the checkpoint is incomplete or its manifest is damaged"
        )
    return items


def _items_for_overlap(chunk: Chunk, inter_off, inter_size, min_segment_bytes: int) -> list[ReadItem]:
    if not chunk.sizes:  # a 0-d tensor
        return [ReadItem(chunk, chunk.byte_start, chunk.byte_end, (), (), (), ())]
    row_elements = _volume(chunk.sizes[1:])
    row_bytes = row_elements * chunk.itemsize
    first_row = inter_off[0] - chunk.offsets[0]
    full_rows = inter_size[1:] == chunk.sizes[1:]
    if not full_rows and len(chunk.sizes) >= 2 and inter_size[2:] == chunk.sizes[2:]:
        # Only some columns: one exact range per row, if those ranges are long enough to be worth a request.
        column_elements = _volume(chunk.sizes[2:])
        segment_bytes = inter_size[1] * column_elements * chunk.itemsize
        if segment_bytes >= min_segment_bytes and reads_by_row(row_bytes, segment_bytes):
            first_column = inter_off[1] - chunk.offsets[1]
            items = []
            for row in range(first_row, first_row + inter_size[0]):
                start = chunk.byte_start + row * row_bytes + first_column * column_elements * chunk.itemsize
                held_off = (chunk.offsets[0] + row, *inter_off[1:])
                held_size = (1, *inter_size[1:])
                items.append(ReadItem(chunk, start, start + segment_bytes, held_off, held_size, held_off, held_size))
            return items
    start = chunk.byte_start + first_row * row_bytes
    held_off = (inter_off[0], *chunk.offsets[1:])
    held_size = (inter_size[0], *chunk.sizes[1:])
    return [ReadItem(chunk, start, start + inter_size[0] * row_bytes, held_off, held_size, inter_off, inter_size)]


def overlap_bytes_read(chunk: Chunk, inter_off, inter_size, min_segment_bytes: int) -> int:
    """The bytes `_items_for_overlap` reads for this overlap, without making its items: exact when
    the overlap is whole rows or read one segment per row, whole rows otherwise."""
    if not chunk.sizes:
        return chunk.byte_end - chunk.byte_start
    row_bytes = _volume(chunk.sizes[1:]) * chunk.itemsize
    needed = _volume(inter_size) * chunk.itemsize
    if inter_size[1:] == chunk.sizes[1:]:
        return needed
    if len(chunk.sizes) >= 2 and inter_size[2:] == chunk.sizes[2:]:
        segment_bytes = inter_size[1] * _volume(chunk.sizes[2:]) * chunk.itemsize
        if segment_bytes >= min_segment_bytes and reads_by_row(row_bytes, segment_bytes):
            return needed
    return inter_size[0] * row_bytes


def reads_by_row(row_bytes, segment_bytes):
    """Whether a column split is read as one range per row (the rest of the row is more than
    1/OVERREAD_DENOMINATOR of the segment) rather than as whole rows. Works on numpy columns too."""
    return (row_bytes - segment_bytes) * OVERREAD_DENOMINATOR > segment_bytes


def check_chunks_disjoint_and_complete(chunks: Iterable[Chunk]) -> None:
    """Every tensor's chunks tile its global shape exactly: no overlap, no gap, within bounds.

    Column-wise over every tensor at once; a tensor the vectorised test cannot clear (a failure,
    or a tiling it does not recognise) is checked again chunk by chunk (`_check_tensor`), which
    also words the error, so the verdict and the message are the sweep's own."""
    table = as_table(chunks if isinstance(chunks, ChunkTable) else list(chunks))
    if not len(table):
        return
    keys, first, group = np.unique(table.tensor_keys(), return_index=True, return_inverse=True)
    group = group.reshape(-1)
    width, ndim, dims = table.width, table.ndim, table.dims
    shape, offsets, sizes = table.boxes["global_shape"], table.boxes["offsets"], table.boxes["sizes"]
    reference = first[group]
    used = np.arange(width) < ndim[:, None]
    suspect = ((shape != shape[reference]).any(axis=1) | (ndim != ndim[reference])
               | (dims["offsets"] != ndim) | (dims["sizes"] != ndim)
               | (((offsets < 0) | (offsets + sizes > shape)) & used).any(axis=1))
    bad = np.zeros(len(keys), bool)
    np.logical_or.at(bad, group, suspect)
    held = np.zeros(len(keys), np.int64)
    np.add.at(held, group, table.volumes())
    needed = np.where(used[first], shape[first], 1).prod(axis=1)
    bad |= held != needed
    bad |= ndim[first] > 2
    counts = np.bincount(group, minlength=len(keys))
    bad |= (ndim[first] == 0) & (counts > 1)
    # Disjoint when, within each column box (dims past 0), the dim-0 intervals do not overlap, and
    # the distinct column boxes of a tensor do not overlap each other (sufficient for ndim <= 2).
    col_off = offsets[:, 1] if width > 1 else np.zeros(len(table), np.int64)
    col_size = sizes[:, 1] if width > 1 else np.zeros(len(table), np.int64)
    order = np.lexsort((offsets[:, 0], col_size, col_off, group))
    g, o1, s1 = group[order], col_off[order], col_size[order]
    o0, e0 = offsets[order, 0], offsets[order, 0] + sizes[order, 0]
    same_box = (g[1:] == g[:-1]) & (o1[1:] == o1[:-1]) & (s1[1:] == s1[:-1])
    bad[g[1:][same_box & (e0[:-1] > o0[1:])]] = True
    new_box = np.r_[True, ~same_box]
    bg, bo, bs = g[new_box], o1[new_box], s1[new_box]
    bad[bg[1:][(bg[1:] == bg[:-1]) & (bo[:-1] + bs[:-1] > bo[1:])]] = True
    for g in sorted(np.flatnonzero(bad).tolist(), key=lambda g: first[g]):
        rows = np.flatnonzero(group == g)
        found = table.chunks_at(rows)
        _check_tensor(found[0].name, found[0].kind, found)


def _check_tensor(name: str, kind: str, group: list[Chunk]) -> None:
    shape = group[0].global_shape
    for chunk in group:
        if chunk.global_shape != shape:
            raise CheckpointError(f"{name} ({kind}): chunks disagree on the global shape ({shape} vs {chunk.global_shape})")
        if any(o < 0 or o + s > g for o, s, g in zip(chunk.offsets, chunk.sizes, shape)) or len(chunk.offsets) != len(shape):
            raise CheckpointError(f"{name} ({kind}): chunk at {chunk.offsets} size {chunk.sizes} lies outside the global "
                                  f"shape {shape}{expert_note(name, shape, group)}")
    total = sum(c.numel for c in group)
    if total != _volume(shape):
        raise CheckpointError(f"{name} ({kind}): chunks hold {total} elements, global shape {shape} needs "
                              f"{_volume(shape)}{expert_note(name, shape, group)}")
    # Sweep along dim 0: only chunks whose row ranges are still open can overlap the next one.
    open_chunks: list[Chunk] = []
    for chunk in sorted(group, key=lambda c: c.offsets):
        row = chunk.offsets[0] if chunk.offsets else 0
        open_chunks = [c for c in open_chunks if (c.offsets[0] + c.sizes[0] if c.offsets else 1) > row]
        for other in open_chunks:
            if _intersect(other.offsets, other.sizes, chunk.offsets, chunk.sizes) is not None or not chunk.offsets:
                raise CheckpointError(f"{name} ({kind}): chunks at {other.offsets} and {chunk.offsets} overlap"
                                      f"{expert_note(name, shape, group)}")
        open_chunks.append(chunk)


def index_chunks(chunks: Iterable[Chunk]) -> ChunkIndex:
    """(name, kind) -> that tensor's chunks, searchable by region (`TableTensor`)."""
    return ChunkIndex(as_table(chunks if isinstance(chunks, ChunkTable) else list(chunks)))


# ---- requests: coalesced byte ranges ------------------------------------------------------------


@dataclass(frozen=True)
class HeaderCheck:
    """Read a file's safetensors header and compare it with the manifest (detects a changed file)."""

    file: str
    byte_start: int
    byte_end: int
    checksum: str

    @property
    def nbytes(self) -> int:
        return self.byte_end - self.byte_start


@dataclass(frozen=True)
class Request:
    """One ranged read of one file; `parts` are the items (and header checks) it serves, by byte."""

    file: str
    byte_start: int
    byte_end: int
    parts: tuple = ()

    @property
    def nbytes(self) -> int:
        return self.byte_end - self.byte_start


def header_checks(chunks: Iterable[Chunk]) -> Mapping[str, HeaderCheck]:
    """Per file, the header range (everything before its first chunk) and its recorded checksum;
    computed column-wise, a `HeaderCheck` made for each file asked about."""
    return FileHeaders(as_table(chunks if isinstance(chunks, ChunkTable) else list(chunks)), HeaderCheck)


def coalesce(parts: Iterable, max_request_bytes: int | None = None) -> list[Request]:
    """Merge parts (anything with file, byte_start, byte_end) of the same file whose byte ranges
    touch or overlap into one request; a merge never grows a request past max_request_bytes."""
    ordered = sorted(parts, key=lambda p: (p.file, p.byte_start, p.byte_end))
    requests: list[Request] = []
    current: list = []
    file, start, end = None, 0, 0
    for part in ordered:
        joins = (part.file == file and part.byte_start <= end
                 and (max_request_bytes is None or max(end, part.byte_end) - start <= max_request_bytes))
        if joins:
            current.append(part)
            end = max(end, part.byte_end)
            continue
        if current:
            requests.append(Request(file, start, end, tuple(current)))
        current, file, start, end = [part], part.file, part.byte_start, part.byte_end
    if current:
        requests.append(Request(file, start, end, tuple(current)))
    return requests


# ---- a rank's plan, and a whole layout's -------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A piece a target rank must fill: one state kind of one tensor, over one region."""

    name: str
    kind: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    # Read once per dp replica group: the rank that reads this region from storage and broadcasts
    # it to its replicas. None: this rank reads it itself.
    receive_from: int | None = None
    itemsize: int = 4


@dataclass
class RankReadPlan:
    rank: int
    items: dict[Target, list[ReadItem]] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    received: list[Target] = field(default_factory=list)  # filled by a replica's broadcast, not read

    @property
    def bytes_received(self) -> int:
        return sum(_volume(t.sizes) * t.itemsize for t in self.received)

    @property
    def bytes_read(self) -> int:
        return sum(r.nbytes for r in self.requests)

    @property
    def bytes_needed(self) -> int:
        return sum(item.needed_bytes for items in self.items.values() for item in items)

    @property
    def files(self) -> int:
        return len({r.file for r in self.requests})


def plan_rank(index: Mapping[tuple[str, str], TensorChunks | TableTensor], targets: Sequence[Target], rank: int = 0,
              headers: Mapping[str, HeaderCheck] | None = None, min_segment_bytes: int = DEFAULT_MIN_SEGMENT_BYTES,
              max_request_bytes: int | None = None, cache: dict | None = None) -> RankReadPlan:
    """Plan one rank's reads. `cache` shares per-region results between ranks that hold the same
    region (dp replicas), which keeps a 768-rank plan fast."""
    plan = RankReadPlan(rank)
    parts: list = []
    for target in targets:
        if target.receive_from is not None:
            plan.received.append(target)
            continue
        key = (target.name, target.kind, target.offsets, target.sizes)
        items = cache.get(key) if cache is not None else None
        if items is None:
            chunks = index.get((target.name, target.kind))
            if chunks is None:
                raise CheckpointError(f"{target.name} ({target.kind}): not in the checkpoint")
            items = plan_reads(chunks, target.offsets, target.sizes, f"{target.name} ({target.kind})", min_segment_bytes)
            if cache is not None:
                cache[key] = items
        plan.items[target] = items
        parts += items
    if headers:
        # A whole-chunk read is verified by the chunk's CRC32; a file read only partly is checked
        # by its header (which carries a per-write nonce) instead.
        partly_read = {item.chunk.file for item in parts if not item.whole_chunk}
        parts += [headers[f] for f in sorted(partly_read) if f in headers]
    plan.requests = coalesce(parts, max_request_bytes)
    return plan
