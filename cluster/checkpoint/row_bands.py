"""A mapping group's outputs produced a row band at a time, so no tensor is ever held whole.

The torchtitan mapping (`plans/interop/torchtitan.py`) only moves whole rows: renames, fused
tensors split into or concatenated from parts (SplitRows / ConcatRows), rows regrouped per head
(RegroupRows), and casts. For such a group every output row is one row of one source, so
running the group's steps once on row NUMBERS (a 1-D int64 tensor per source, tagged with the
source's index) gives, for each output row, where it comes from: `row_origins`. An output band
[r0, r1) is then filled by reading just the source rows it needs (`fill_band`), in runs of
nearby rows, each run read once into a buffer no larger than two bands.

Memory: one output band plus one run of source rows (a band is BAND_BYTES, default 64 MiB,
whatever the tensor's size), which is what bounds an import's or export's peak memory.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rayshard.cluster.checkpoint.transform_exec import run_group
from rayshard.plans.errors import CheckpointError
from rayshard.plans.transforms.mapping import Cast, ConcatRows, Group, Meta, RegroupRows, Rename, SplitRows

BAND_BYTES = 64 * 2**20
_ROW_STEPS = (Rename, SplitRows, ConcatRows, RegroupRows, Cast)
_SOURCE_BITS = 40  # row numbers below 2**40; the source's index above them


@dataclass(frozen=True)
class RowOrigins:
    """For one output tensor: its source names, and for each of its rows (one entry for a 0-d
    tensor) the index of its source and the source row."""

    sources: tuple[str, ...]
    source_of_row: torch.Tensor  # int64 [rows]
    row_in_source: torch.Tensor  # int64 [rows]


def row_origins(group: Group, metas: dict[str, Meta]) -> dict[str, RowOrigins]:
    """Where each output row of the group comes from (its steps must all be row steps)."""
    for step in group.steps:
        if not isinstance(step.rule, _ROW_STEPS):
            raise CheckpointError(f"{type(step.rule).__name__} on {', '.join(step.inputs)}: the streaming converter moves "
                                  "whole rows only (renames, split/concatenated rows, regrouped rows, casts)")
    row_steps = Group(group.sources, tuple(s for s in group.steps if not isinstance(s.rule, Cast)), group.outputs)
    numbers = {name: _row_numbers(index, metas[name].shape) for index, name in enumerate(group.sources)}
    mapped = run_group(row_steps, numbers)
    return {name: RowOrigins(group.sources, tags >> _SOURCE_BITS, tags & ((1 << _SOURCE_BITS) - 1))
            for name, tags in ((name, mapped[name].reshape(-1)) for name in group.outputs)}


def _row_numbers(index: int, shape: tuple[int, ...]) -> torch.Tensor:
    rows = shape[0] if shape else 1
    if rows >= 1 << _SOURCE_BITS:
        raise CheckpointError(f"a tensor of {rows} rows is beyond the converter's row numbering")
    numbers = torch.arange(rows, dtype=torch.int64) + (index << _SOURCE_BITS)
    return numbers if shape else numbers.reshape(())


def bands(shape: tuple[int, ...], itemsize: int, band_bytes: int = BAND_BYTES) -> list[tuple[int, int]]:
    """Row ranges [r0, r1) of at most band_bytes each (one row at least); one band for a 0-d tensor."""
    if not shape:
        return [(0, 1)]
    row_bytes = itemsize
    for extent in shape[1:]:
        row_bytes *= extent
    per_band = max(1, band_bytes // max(row_bytes, 1))
    return [(start, min(start + per_band, shape[0])) for start in range(0, shape[0], per_band)] or [(0, 0)]


ReadRows = Callable[[str, int, int, torch.Tensor], None]  # (source, first row, end row, into) fills `into`
# (source, first row, end row) -> those rows' bytes, uint8 [rows, row bytes], over the source's own
# storage (a memory map of the file's page cache), or None where the reader cannot (rows across
# chunks, an object store).
RowView = Callable[[str, int, int], "torch.Tensor | None"]
MAX_SEGMENTS = 4096  # per source and band: past it, per-segment copies cost more than a second copy


@contextlib.contextmanager
def one_torch_thread():
    """Band work is copies of a few MiB at a time, which one thread does at memory speed; torch's
    intra-op pool only adds its synchronisation. On the shared 2-core machine a 12 MiB gather took
    29 ms on two threads and 3.6 ms on one (bench/RESULTS.md, decision 110). Restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class Buffers:
    """Reused memory for consecutive bands: `take(slot, shape, dtype)` gives a tensor over the
    slot's buffer, grown when a band needs more. A band's memory is then touched once for the whole
    import (a fresh 64 MiB tensor per band costs a page fault and a zero fill per 4 KiB page), so a
    caller may only take a slot again once it is done with what the slot last held."""

    def __init__(self):
        self.slots: dict[str, torch.Tensor] = {}

    def take(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        count = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        held = self.slots.get(slot)
        if held is None or held.numel() < count:
            held = self.slots[slot] = torch.empty(max(count, 1), dtype=torch.uint8)
        return held[:count].view(dtype).reshape(shape)


def _fresh(slot: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def fill_band(origins: RowOrigins, first: int, end: int, out: torch.Tensor, source_shapes: dict[str, tuple],
              source_dtypes: dict[str, torch.dtype], read_rows: ReadRows, scratch=_fresh,
              row_view: RowView | None = None) -> torch.Tensor:
    """Output rows [first, end) (shape [end - first, *row shape], or 0-d for a 0-d tensor): `out`
    filled, or with `row_view`, possibly a view of the source's own bytes instead.

    A band that is one run of consecutive rows of one source of the same dtype is read straight into
    `out`, or is that run's view; otherwise runs of nearby source rows are read into one buffer and
    gathered into `out` (with views: gathered from the views, one copy per byte)."""
    which, rows = origins.source_of_row[first:end], origins.row_in_source[first:end]
    if row_view is not None and out.dim() > 0 and end > first:
        viewed = _from_views(origins, which, rows, out, source_dtypes, row_view)
        if viewed is not None:
            return viewed
    if out.dim() == 0:
        source = origins.sources[int(which[0])]
        if source_dtypes[source] == out.dtype:
            read_rows(source, 0, 1, out)
        else:
            scratch = torch.empty((), dtype=source_dtypes[source])
            read_rows(source, 0, 1, scratch)
            out.copy_(scratch)
        return out
    count = end - first
    if count == 0:
        return out
    one_source = bool((which == which[0]).all())
    if one_source and int(rows[-1]) - int(rows[0]) == count - 1 and bool((rows.diff() == 1).all()):
        source = origins.sources[int(which[0])]
        if source_dtypes[source] == out.dtype:
            read_rows(source, int(rows[0]), int(rows[0]) + count, out)
            return out
    # Runs of nearby rows of each source, stacked in one buffer of the output's dtype, then one
    # gather (index_select: a row copy each, no per-element scatter) into `out`.
    limit = max(2 * count, 1)
    runs, total = [], 0
    for index in torch.unique(which).tolist():
        positions = torch.nonzero(which == index).reshape(-1)
        wanted = rows[positions]
        order = torch.argsort(wanted)
        positions, wanted = positions[order], wanted[order]
        start = 0
        while start < len(wanted):
            low = int(wanted[start])
            stop = int(torch.searchsorted(wanted, low + limit))  # the sorted rows within `limit` rows of `low`
            high = int(wanted[stop - 1]) + 1
            runs.append((origins.sources[index], low, high, positions[start:stop], wanted[start:stop]))
            total += high - low
            start = stop
    buffer = scratch("gather", (total, *out.shape[1:]), out.dtype)
    gather = torch.empty(count, dtype=torch.int64)
    base = 0
    for source, low, high, positions, wanted in runs:
        place = buffer[base:base + high - low]
        if source_dtypes[source] == out.dtype:
            read_rows(source, low, high, place)
        else:
            cast = torch.empty((high - low, *source_shapes[source][1:]), dtype=source_dtypes[source])
            read_rows(source, low, high, cast)
            place.copy_(cast)
            del cast
        gather[positions] = wanted - low + base
        base += high - low
    torch.index_select(buffer, 0, gather, out=out)
    return out


def _from_views(origins: RowOrigins, which: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                source_dtypes: dict[str, torch.dtype], row_view: RowView) -> torch.Tensor | None:
    """The band from views of its sources' rows, copying each byte once (a read into a buffer and
    a gather copy it twice): a band that is one run of one source is the run's view itself (no
    copy: the writer writes from the page cache); otherwise, per source, consecutive source rows
    going to evenly spaced output rows are one strided copy (gate_up's interleave), and rows going
    to consecutive output rows are gathered straight into them (`index_select(out=...)`, per
    segment: qkv's blocks). None where a view is not to be had, a dtype differs, or the rows are
    scattered otherwise: the caller reads as before. (Byte rows: `index_copy_` on uint8 runs
    element by element, 40x slower than a copy, so it is not used.)"""
    count = len(rows)
    copies = []
    for index in torch.unique(which).tolist():
        source = origins.sources[index]
        if source_dtypes[source] != out.dtype:
            return None
        positions = torch.nonzero(which == index).reshape(-1)
        wanted = rows[positions]
        low, high = int(wanted.min()), int(wanted.max()) + 1
        if high - low > 2 * count:  # a view far wider than the band: its pages would be mapped for nothing
            return None
        steps = positions.diff()
        consecutive = bool((wanted.diff() == 1).all())
        if consecutive and (len(positions) == 1 or bool((steps == steps[0]).all())):
            step = int(steps[0]) if len(positions) > 1 else 1
            copies.append((source, low, high, "strided", (int(positions[0]), step)))
            continue
        breaks = (torch.nonzero(steps != 1).reshape(-1) + 1).tolist()
        if len(breaks) + 1 > MAX_SEGMENTS:
            return None
        segments = [(int(positions[a]), wanted[a:b] - low) for a, b in zip([0, *breaks], [*breaks, len(positions)])]
        copies.append((source, low, high, "segments", segments))
    if len(copies) == 1 and copies[0][3] == "strided" and copies[0][4][1] == 1 and copies[0][2] - copies[0][1] == count:
        source, low, high, _, _ = copies[0]
        view = row_view(source, low, high)
        return None if view is None else view.view(out.dtype).reshape(out.shape)  # no copy at all
    views = [row_view(source, low, high) for source, low, high, _, _ in copies]
    if any(view is None for view in views):
        return None
    out_rows = out.view(torch.uint8).reshape(count, -1)  # the band's rows as bytes, like the views
    for view, (_, low, high, how, detail) in zip(views, copies):
        if how == "strided":
            place, step = detail
            out_rows[place:place + step * (high - low - 1) + 1:step].copy_(view)
            continue
        for place, local in detail:
            torch.index_select(view, 0, local, out=out_rows[place:place + len(local)])
    return out
