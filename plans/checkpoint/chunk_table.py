"""A manifest's chunks as columns: the form every hot path reads (loads, planning, verify, ls).

A 16k-rank FSDP checkpoint lists ~826k chunks; one Python object per chunk cost ~6 s to decode and
~2.9 GiB on the driver. Here strings are dictionary-encoded (a code per row, each distinct name,
kind, dtype, file and header once), shapes, offsets and sizes are numpy int64 matrices padded to
the largest rank (`ndim` says how many columns count), and byte ranges numpy int64 columns. A
`Chunk` is made only for the rows a caller touches (`chunk`, `chunks_at`); iterating the table
makes every one, which is what small checkpoints and rare paths do.

Pure: numpy and pyarrow, no torch, no Ray.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rayshard.plans.checkpoint.chunks import Chunk

STRING_COLUMNS = ("name", "kind", "dtype", "file", "file_header")
BOX_COLUMNS = ("global_shape", "offsets", "sizes")


def _dictionary(column) -> tuple[np.ndarray, list[str]]:
    """(codes, values) of a string or dictionary column (a pyarrow ChunkedArray or Array)."""
    if isinstance(column, pa.ChunkedArray):
        if pa.types.is_dictionary(column.type):
            column = column.unify_dictionaries()
            pieces = column.chunks
            if not pieces:
                return np.zeros(0, np.int32), []
            codes = np.concatenate([p.indices.to_numpy(zero_copy_only=False) for p in pieces]).astype(np.int32, copy=False)
            return codes, pieces[0].dictionary.to_pylist()
        column = column.combine_chunks()
    if not pa.types.is_dictionary(column.type):
        column = column.dictionary_encode()
    return column.indices.to_numpy(zero_copy_only=False).astype(np.int32, copy=False), column.dictionary.to_pylist()


def _padded(column) -> tuple[np.ndarray, np.ndarray]:
    """(values padded to (rows, width) with zeros, lengths) of a list<int64> column."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    bounds = column.offsets.to_numpy().astype(np.int64)
    values = column.values.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
    values = values[bounds[0]:bounds[-1]]
    lengths = np.diff(bounds)
    rows = len(lengths)
    width = max(1, int(lengths.max())) if rows else 1
    padded = np.zeros((rows, width), np.int64)
    starts = bounds[:-1] - bounds[0]
    for dim in range(width):  # one column at a time: a handful of vector ops, no per-value scatter
        has = lengths > dim
        padded[:, dim] = np.where(has, values[np.minimum(starts + dim, max(len(values) - 1, 0))], 0) if len(values) else 0
    return padded, lengths


class ChunkTable(Sequence):
    """Every chunk of a manifest, column-wise. A Sequence of `Chunk` for callers that want records."""

    def __init__(self, codes: dict[str, np.ndarray], values: dict[str, list[str]], dims: dict[str, np.ndarray],
                 boxes: dict[str, np.ndarray], byte_start: np.ndarray, byte_end: np.ndarray, checksums):
        # dims: each box column's length per row (a damaged manifest may disagree; ndim is the shape's)
        self.codes, self.values, self.dims, self.boxes = codes, values, dims, boxes
        self.ndim = dims["global_shape"]
        self.byte_start, self.byte_end = byte_start, byte_end
        self._checksums = checksums  # a pyarrow string array, a list of str, or (unpickled) numpy bytes
        self._made: dict[int, Chunk] = {}
        self._code_of: dict[str, dict[str, int]] = {}

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_arrow(cls, table: pa.Table) -> "ChunkTable":
        rows = table.num_rows
        codes, values = {}, {}
        for name in STRING_COLUMNS:
            if name in table.column_names:
                column = table.column(name)
                if column.null_count:  # file_header may hold nulls: read as "" (no header recorded)
                    column = pc.fill_null(column.cast(pa.string()), "")
                codes[name], values[name] = _dictionary(column)
            else:  # file_header: absent in format 1.0
                codes[name], values[name] = np.zeros(rows, np.int32), [""]
        boxes, dims = {}, {}
        for name in BOX_COLUMNS:
            boxes[name], dims[name] = _padded(table.column(name))
        width = max(b.shape[1] for b in boxes.values())
        boxes = {k: b if b.shape[1] == width else np.pad(b, ((0, 0), (0, width - b.shape[1]))) for k, b in boxes.items()}
        checksums = table.column("checksum")
        checksums = checksums.combine_chunks() if isinstance(checksums, pa.ChunkedArray) else checksums
        if pa.types.is_dictionary(checksums.type):
            checksums = checksums.cast(pa.string())
        return cls(codes, values, dims, boxes,
                   table.column("byte_start").to_numpy().astype(np.int64, copy=False),
                   table.column("byte_end").to_numpy().astype(np.int64, copy=False), checksums)

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk]) -> "ChunkTable":
        if isinstance(chunks, ChunkTable):
            return chunks
        chunks = list(chunks)
        codes, values = {}, {}
        for name in STRING_COLUMNS:
            seen: dict[str, int] = {}
            codes[name] = np.fromiter((seen.setdefault(getattr(c, name), len(seen)) for c in chunks), np.int32, len(chunks))
            values[name] = list(seen)
        dims = {name: np.fromiter((len(getattr(c, name)) for c in chunks), np.int64, len(chunks)) for name in BOX_COLUMNS}
        width = max([1] + [int(d.max()) for d in dims.values() if len(d)])
        boxes = {}
        for name in BOX_COLUMNS:
            box = np.zeros((len(chunks), width), np.int64)
            for length in range(1, width + 1):  # the rows of each length at once
                rows = np.flatnonzero(dims[name] == length)
                if len(rows):
                    box[rows, :length] = [getattr(chunks[r], name) for r in rows]
            boxes[name] = box
        table = cls(codes, values, dims, boxes,
                    np.fromiter((c.byte_start for c in chunks), np.int64, len(chunks)),
                    np.fromiter((c.byte_end for c in chunks), np.int64, len(chunks)), [c.checksum for c in chunks])
        table._made = dict(enumerate(chunks))
        return table

    @classmethod
    def concat(cls, tables: Sequence["ChunkTable"]) -> "ChunkTable":
        """One table of several (the save gather: every rank's table at once)."""
        tables = [t for t in tables if len(t)] or list(tables[:1])
        if len(tables) == 1:
            return tables[0]
        codes, values = {}, {}
        for name in STRING_COLUMNS:  # one dictionary over every table's, built by pyarrow
            shift = np.cumsum([0] + [len(t.values[name]) for t in tables[:-1]])
            raw = np.concatenate([t.codes[name] + int(s) for t, s in zip(tables, shift.tolist())])
            encoded = pa.array([v for t in tables for v in t.values[name]], pa.string()).dictionary_encode()
            codes[name] = encoded.indices.to_numpy().astype(np.int32)[raw]
            values[name] = encoded.dictionary.to_pylist()
        width = max(t.width for t in tables)
        boxes = {name: np.concatenate([t.boxes[name] if t.width == width else np.pad(t.boxes[name], ((0, 0), (0, width - t.width)))
                                       for t in tables]) for name in BOX_COLUMNS}
        # One Arrow string array, not a Python string per chunk (16k ranks: 826k of them).
        if all(isinstance(t._checksums, np.ndarray) for t in tables):
            checksums = pa.array(np.concatenate([t._checksums for t in tables]), pa.binary()).cast(pa.string())
        else:
            checksums = pa.concat_arrays([t.checksum_array() for t in tables])
        return cls(codes, values, {name: np.concatenate([t.dims[name] for t in tables]) for name in BOX_COLUMNS}, boxes,
                   np.concatenate([t.byte_start for t in tables]), np.concatenate([t.byte_end for t in tables]), checksums)

    def to_arrow(self, schema: pa.Schema) -> pa.Table:
        columns = {}
        for name in STRING_COLUMNS:
            columns[name] = pa.DictionaryArray.from_arrays(pa.array(self.codes[name], pa.int32()),
                                                           pa.array(self.values[name], pa.string())).cast(pa.string())
        for name in BOX_COLUMNS:
            offsets = pa.array(np.concatenate([[0], np.cumsum(self.dims[name])]).astype(np.int32))
            keep = np.arange(self.width) < self.dims[name][:, None]
            columns[name] = pa.ListArray.from_arrays(offsets, pa.array(self.boxes[name][keep], pa.int64()))
        columns["byte_start"], columns["byte_end"] = pa.array(self.byte_start), pa.array(self.byte_end)
        columns["checksum"] = self.checksum_array()
        return pa.Table.from_pydict({name: columns[name] for name in schema.names}, schema=schema)

    # ---- records ----------------------------------------------------------------------------

    @property
    def width(self) -> int:
        return self.boxes["offsets"].shape[1]

    def __len__(self) -> int:
        return len(self.byte_start)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.chunks_at(np.arange(len(self))[index])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self.chunks_at(np.array([index]))[0]

    def __iter__(self) -> Iterator[Chunk]:
        return iter(self.chunks_at(np.arange(len(self))))

    def __eq__(self, other) -> bool:
        if isinstance(other, (ChunkTable, list, tuple)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"ChunkTable({len(self)} chunks, {len(self.values['file'])} files)"

    def __getstate__(self) -> dict:
        """The columns only, packed (a rank ships its table to the driver through Ray, and 16k
        ranks' tables are unpickled there): every integer column in one int64 matrix, checksums
        in one fixed-width bytes array, records made and lookups cached left behind."""
        width = self.width
        columns = ([self.codes[name] for name in STRING_COLUMNS] + [self.dims[name] for name in BOX_COLUMNS]
                   + [self.boxes[name][:, d] for name in BOX_COLUMNS for d in range(width)]
                   + [self.byte_start, self.byte_end])
        packed = np.array(columns, np.int64).reshape(len(columns), len(self))
        return {"values": self.values, "width": width, "packed": packed,
                "checksums": np.array(self.checksum_array().to_pylist(), np.bytes_)}

    def __setstate__(self, state: dict) -> None:
        packed, width, strings = state["packed"], state["width"], len(STRING_COLUMNS)
        boxes_at = strings + len(BOX_COLUMNS)
        self.codes = {name: packed[i] for i, name in enumerate(STRING_COLUMNS)}
        self.dims = {name: packed[strings + i] for i, name in enumerate(BOX_COLUMNS)}
        self.boxes = {name: packed[boxes_at + i * width:boxes_at + (i + 1) * width].T for i, name in enumerate(BOX_COLUMNS)}
        self.values, self.ndim = state["values"], self.dims["global_shape"]
        self.byte_start, self.byte_end = packed[-2], packed[-1]
        self._checksums, self._made, self._code_of = state["checksums"], {}, {}

    def checksum_array(self) -> pa.Array:
        checksums = self._checksums
        if isinstance(checksums, list):
            return pa.array(checksums, pa.string())
        if isinstance(checksums, np.ndarray):  # unpickled: fixed-width ASCII bytes
            return pa.array(checksums, pa.binary()).cast(pa.string())
        return checksums.combine_chunks() if isinstance(checksums, pa.ChunkedArray) else checksums

    def checksum_list(self) -> list[str]:
        if not isinstance(self._checksums, list):
            self._checksums = self.checksum_array().to_pylist()
        return self._checksums

    def chunks_at(self, rows: np.ndarray) -> list[Chunk]:
        """The `Chunk` records of these rows (made once each, then kept)."""
        rows = [int(r) for r in rows]
        missing = [r for r in rows if r not in self._made]
        if missing:
            picked = np.array(missing, np.int64)
            if isinstance(self._checksums, list):
                sums = [self._checksums[r] for r in missing]
            elif len(missing) * 8 > len(self) or isinstance(self._checksums, np.ndarray):
                sums = [self.checksum_list()[r] for r in missing]
            else:
                sums = self._checksums.take(pa.array(picked)).to_pylist()
            text = {name: [self.values[name][c] for c in self.codes[name][picked].tolist()] for name in STRING_COLUMNS}
            boxes = {name: self.boxes[name][picked].tolist() for name in BOX_COLUMNS}
            lengths = {name: self.dims[name][picked].tolist() for name in BOX_COLUMNS}
            starts, ends = self.byte_start[picked].tolist(), self.byte_end[picked].tolist()
            shape_len, offsets_len, sizes_len = lengths["global_shape"], lengths["offsets"], lengths["sizes"]
            for i, row in enumerate(missing):
                self._made[row] = Chunk(text["name"][i], text["kind"][i], text["dtype"][i],
                                        tuple(boxes["global_shape"][i][:shape_len[i]]),
                                        tuple(boxes["offsets"][i][:offsets_len[i]]),
                                        tuple(boxes["sizes"][i][:sizes_len[i]]), text["file"][i], starts[i], ends[i],
                                        sums[i], text["file_header"][i] or "")
        return [self._made[r] for r in rows]

    # ---- column-wise questions ---------------------------------------------------------------

    def code(self, column: str, value: str) -> int | None:
        lookup = self._code_of.get(column)
        if lookup is None:
            lookup = self._code_of[column] = {v: i for i, v in enumerate(self.values[column])}
        return lookup.get(value)

    def tensor_keys(self) -> np.ndarray:
        """One int64 per row naming its (name, kind)."""
        return self.codes["name"].astype(np.int64) * max(1, len(self.values["kind"])) + self.codes["kind"]

    def first_of_each_tensor(self, last: bool = False) -> dict[tuple[str, str], Chunk]:
        """(name, kind) -> the first chunk listed for it (the last one with last=True), in
        first-listed order."""
        keys = self.tensor_keys()
        _, first = np.unique(keys, return_index=True)
        if not last:
            return {(c.name, c.kind): c for c in self.chunks_at(np.sort(first))}
        _, from_end = np.unique(keys[::-1], return_index=True)
        rows = (len(keys) - 1 - from_end)[np.argsort(first)]
        return {(c.name, c.kind): c for c in self.chunks_at(rows)}

    def kinds(self) -> set[str]:
        return {self.values["kind"][c] for c in np.unique(self.codes["kind"]).tolist()}

    def file_extents(self) -> dict[str, int]:
        """file -> the end of its last chunk (how long the file must be), in first-listed order."""
        extent = np.zeros(len(self.values["file"]), np.int64)
        np.maximum.at(extent, self.codes["file"], self.byte_end)
        used = np.unique(self.codes["file"], return_index=True)
        order = used[0][np.argsort(used[1])]
        return {self.values["file"][c]: int(extent[c]) for c in order.tolist()}

    def file_counts(self) -> dict[str, int]:
        counts = np.bincount(self.codes["file"], minlength=len(self.values["file"]))
        return {self.values["file"][c]: int(counts[c]) for c in np.flatnonzero(counts).tolist()}

    def rows_by_file(self) -> dict[str, np.ndarray]:
        """file -> its rows, in listed order."""
        order = np.argsort(self.codes["file"], kind="stable")
        codes = self.codes["file"][order]
        cuts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1], True])
        return {self.values["file"][int(codes[a])]: order[a:b] for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist())}

    def file_names(self) -> list[str]:
        """The files some chunk lives in."""
        return [self.values["file"][c] for c in np.unique(self.codes["file"]).tolist()]

    def total_bytes(self) -> int:
        return int((self.byte_end - self.byte_start).sum())

    def volumes(self) -> np.ndarray:
        keep = np.arange(self.width) < self.dims["sizes"][:, None]
        return np.where(keep, self.boxes["sizes"], 1).prod(axis=1)


def as_table(chunks: Sequence[Chunk]) -> ChunkTable:
    return chunks if isinstance(chunks, ChunkTable) else ChunkTable.from_chunks(chunks)


class FileHeaders(Mapping):
    """file -> (first chunk's start, recorded header checksum), computed column-wise; the
    `HeaderCheck` records are made for the files a caller asks about."""

    def __init__(self, table: ChunkTable, make):
        self._table, self._make = table, make
        has = table.codes["file_header"] != (table.code("file_header", "") if table.code("file_header", "") is not None else -1)
        files = table.codes["file"][has]
        self._first = np.full(len(table.values["file"]), -1, np.int64)
        self._header = np.full(len(table.values["file"]), -1, np.int64)
        if len(files):
            order = np.lexsort((table.byte_start[has], files))
            files_sorted = files[order]
            starts = np.flatnonzero(np.r_[True, files_sorted[1:] != files_sorted[:-1]])
            self._first[files_sorted[starts]] = table.byte_start[has][order][starts]
            self._header[files] = table.codes["file_header"][has]  # every chunk of a file records the same header
        self._made: dict[str, object] = {}

    def _code(self, file: str) -> int | None:
        code = self._table.code("file", file)
        return code if code is not None and self._first[code] >= 0 else None

    def __getitem__(self, file: str):
        made = self._made.get(file)
        if made is None:
            code = self._code(file)
            if code is None:
                raise KeyError(file)
            made = self._made[file] = self._make(file, 0, int(self._first[code]),
                                                 self._table.values["file_header"][int(self._header[code])])
        return made

    def __contains__(self, file) -> bool:
        return self._code(file) is not None

    def first_chunk_starts(self) -> np.ndarray:
        """Per file code of the table: its header's end (the first chunk's start), -1 where the
        manifest records no header."""
        return self._first.copy()

    def __iter__(self):
        return (self._table.values["file"][c] for c in np.flatnonzero(self._first >= 0).tolist())

    def __len__(self) -> int:
        return int((self._first >= 0).sum())
