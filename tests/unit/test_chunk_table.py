"""The manifest's chunks as columns (`plans/checkpoint/chunk_table.py`): the same records, the
same answers as a list of `Chunk`, and the tiling check's verdicts and messages unchanged."""
import dataclasses
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayshard.plans.checkpoint.chunk_table import ChunkTable, as_table
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.manifest.codec import MANIFEST_SCHEMA, decode_manifest, encode_manifest
from rayshard.plans.checkpoint.reshard import (TensorChunks, _check_tensor, check_chunks_disjoint_and_complete, header_checks,
                                      index_chunks, plan_reads)
from rayshard.plans.errors import CheckpointError


def grid(name="w", kind="param", rows=10, cols=6, row_cuts=(0, 3, 7), col_cuts=(0, 4), file="f", header="crc32:h"):
    chunks, start = [], 100
    for ci, c0 in enumerate(col_cuts):
        c1 = (col_cuts + (cols,))[ci + 1]
        for ri, r0 in enumerate(row_cuts):
            r1 = (row_cuts + (rows,))[ri + 1]
            size = (r1 - r0) * (c1 - c0) * 4
            chunks.append(Chunk(name, kind, "float32", (rows, cols), (r0, c0), (r1 - r0, c1 - c0), file, start,
                                start + size, f"crc32:{start:08x}", header))
            start += size
    return chunks


def sample():
    return (grid() + grid(kind="exp_avg", file="g", header="")
            + [Chunk("norm", "param", "float32", (6,), (0,), (6,), "g", 7, 31, "crc32:0000000n", "")])


def test_round_trip_keeps_every_record_and_its_order():
    chunks = sample()
    decoded, metadata = decode_manifest(encode_manifest(chunks, {"step": 1}))
    assert isinstance(decoded, ChunkTable) and decoded == chunks and list(decoded) == chunks
    assert decoded[3] == chunks[3] and decoded[-1] == chunks[-1] and decoded[1:3] == chunks[1:3]
    again, _ = decode_manifest(encode_manifest(decoded, {"step": 1}))  # encoded from columns
    assert again == chunks
    assert decoded.file_extents() == {"f": max(c.byte_end for c in chunks if c.file == "f"),
                                      "g": max(c.byte_end for c in chunks if c.file == "g")}
    assert decoded.total_bytes() == sum(c.byte_end - c.byte_start for c in chunks)
    assert decoded.kinds() == {"param", "exp_avg"}
    assert decoded.first_of_each_tensor() == {("w", "param"): chunks[0], ("w", "exp_avg"): chunks[6], ("norm", "param"): chunks[-1]}


def test_a_format_1_0_manifest_without_headers_still_decodes():
    chunks = sample()
    table = pa.Table.from_pydict({n: [getattr(c, n) for c in chunks] for n in MANIFEST_SCHEMA.names if n != "file_header"})
    table = table.replace_schema_metadata({b"rayshard": b'{"format_version": "1.0"}'})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    decoded, _ = decode_manifest(sink.getvalue().to_pybytes())
    assert list(decoded) == [Chunk(**{**c.__dict__, "file_header": ""}) for c in chunks]
    assert dict(header_checks(decoded)) == {}


def test_concat_of_rank_tables_is_the_gathered_list():
    chunks = sample()
    parts = [ChunkTable.from_chunks(chunks[:4]), ChunkTable.from_chunks(chunks[4:9]), ChunkTable.from_chunks(chunks[9:])]
    assert ChunkTable.concat(parts) == chunks


def test_index_finds_the_same_overlaps_as_the_record_index():
    chunks = sample()
    table, _ = decode_manifest(encode_manifest(chunks, {"step": 1}))
    index = index_chunks(table)
    assert list(index) == [("w", "param"), ("w", "exp_avg"), ("norm", "param")]
    rng = random.Random(0)
    for _ in range(200):
        r0, c0 = rng.randrange(10), rng.randrange(6)
        box = ((r0, c0), (rng.randint(1, 10 - r0), rng.randint(1, 6 - c0)))
        assert plan_reads(index[("w", "param")], *box) == plan_reads(TensorChunks(chunks[:6]), *box)
    headers = header_checks(table)
    assert "f" in headers and "g" not in headers and headers["f"].byte_end == 100 and headers["f"].checksum == "crc32:h"


@pytest.mark.parametrize("damage", ["overlap", "gap", "outside", "shape", "zero-d twice", "three-d"])
def test_tiling_check_gives_the_sweeps_verdict_and_message(damage):
    chunks = grid()
    if damage == "overlap":  # same volume, one chunk moved onto its neighbour
        c = chunks[1]
        chunks[1] = Chunk(c.name, c.kind, c.dtype, c.global_shape, (2, 0), c.sizes, c.file, c.byte_start, c.byte_end, c.checksum)
    elif damage == "gap":
        del chunks[2]
    elif damage == "outside":
        c = chunks[2]
        chunks[2] = Chunk(c.name, c.kind, c.dtype, c.global_shape, (8, 0), c.sizes, c.file, c.byte_start, c.byte_end, c.checksum)
    elif damage == "shape":
        c = chunks[4]
        chunks[4] = Chunk(c.name, c.kind, c.dtype, (10, 7), c.offsets, c.sizes, c.file, c.byte_start, c.byte_end, c.checksum)
    elif damage == "zero-d twice":
        chunks = [Chunk("s", "param", "float32", (), (), (), "f", 0, 4, "crc32:0")] * 2
    else:  # three dims: a tiling the vectorised test leaves to the sweep (here a valid one)
        chunks = [Chunk("t", "param", "float32", (2, 2, 2), (i, 0, 0), (1, 2, 2), "f", 16 * i, 16 * i + 16, "crc32:0")
                  for i in range(2)]
    expected = None
    try:
        _check_tensor(chunks[0].name, chunks[0].kind, chunks)
    except CheckpointError as error:
        expected = str(error)
    for form in (chunks, ChunkTable.from_chunks(chunks)):
        if expected is None:
            check_chunks_disjoint_and_complete(form)
        else:
            with pytest.raises(CheckpointError) as raised:
                check_chunks_disjoint_and_complete(form)
            assert str(raised.value) == expected
    assert (expected is None) == (damage == "three-d")


def _chunk(name, kind, shape, offset, size, file, start):
    nbytes = 4 * size
    return Chunk(name, kind, "float32", (shape,), (offset,), (size,), file, start, start + nbytes,
                 f"crc32:{start:08x}", "")


# Files listed out of order and interleaved: z, y, y, x, z.
MIXED = [_chunk("a", "param", 4, 0, 2, "z", 0), _chunk("b", "param", 12, 0, 4, "y", 0), _chunk("a", "param", 4, 2, 2, "y", 16),
         _chunk("a", "exp_avg", 2, 0, 2, "x", 4), _chunk("b", "param", 12, 4, 8, "z", 8)]


def test_per_file_answers_group_rows_by_file_in_listed_order():
    table = ChunkTable.from_chunks(MIXED)
    assert table.file_counts() == {"z": 2, "y": 2, "x": 1}
    assert {file: rows.tolist() for file, rows in table.rows_by_file().items()} == {"z": [0, 4], "y": [1, 2], "x": [3]}
    assert sorted(table.file_names()) == ["x", "y", "z"]
    extents = table.file_extents()
    assert extents == {"z": 40, "y": 24, "x": 12} and list(extents) == ["z", "y", "x"]  # first-listed order


def test_first_and_last_chunk_of_each_tensor_in_first_listed_order():
    table = ChunkTable.from_chunks(MIXED)
    first = table.first_of_each_tensor()
    assert list(first) == [("a", "param"), ("b", "param"), ("a", "exp_avg")]
    assert list(first.values()) == [MIXED[0], MIXED[1], MIXED[3]]
    last = table.first_of_each_tensor(last=True)
    assert list(last) == [("a", "param"), ("b", "param"), ("a", "exp_avg")]
    assert list(last.values()) == [MIXED[2], MIXED[4], MIXED[3]]


def test_concat_of_tables_with_different_widths_and_dictionaries_is_the_list():
    flat = [ChunkTable.from_chunks(MIXED[:2]), ChunkTable.from_chunks(MIXED[2:])]
    square = ChunkTable.from_chunks(grid(name="m", rows=4, cols=4, row_cuts=(0, 2), col_cuts=(0,), file="q"))
    joined = ChunkTable.concat([flat[0], square, ChunkTable.from_chunks([]), flat[1]])
    assert joined == MIXED[:2] + list(square) + MIXED[2:]
    assert joined.file_counts() == {"z": 2, "y": 2, "x": 1, "q": 2}
    assert ChunkTable.concat([ChunkTable.from_chunks([]), square]) == list(square)


def _plain_arrow(chunks, batches=2):
    """A manifest table as `pa.Table.from_pydict` gives it: plain string columns (no dictionaries),
    split into `batches` record batches, so every column is a ChunkedArray of several pieces."""
    table = pa.Table.from_pydict({n: [c.to_row()[n] for c in chunks] for n in MANIFEST_SCHEMA.names}, schema=MANIFEST_SCHEMA)
    step = -(-len(chunks) // batches)
    return pa.Table.from_batches([b for i in range(0, len(chunks), step) for b in table.slice(i, step).to_batches()])


def _fields_are_ints(table):
    return all(type(v) is int for c in table for v in (*c.global_shape, *c.offsets, *c.sizes, c.byte_start, c.byte_end))


def test_a_plain_arrow_table_in_several_batches_decodes_to_the_same_records():
    chunks = sample()
    arrow = _plain_arrow(chunks, batches=3)
    assert arrow.column("name").num_chunks == 3 and not pa.types.is_dictionary(arrow.column("name").type)
    table = ChunkTable.from_arrow(arrow)
    assert list(table) == chunks and table.kinds() == {"param", "exp_avg"}
    assert table.file_counts() == {"f": 6, "g": 7}
    assert _fields_are_ints(table)  # int64 columns, not floats: byte ranges and boxes index tensors and files


def test_a_decoded_manifest_gives_int_fields():
    table, _ = decode_manifest(encode_manifest(sample(), {"step": 1}))
    assert _fields_are_ints(table)


def test_a_dictionary_encoded_checksum_column_reads_as_strings():
    chunks = sample()
    arrow = _plain_arrow(chunks, batches=1)
    arrow = arrow.set_column(arrow.schema.get_field_index("checksum"), "checksum", arrow.column("checksum").dictionary_encode())
    table = ChunkTable.from_arrow(arrow)
    assert list(table) == chunks
    # Joined with a table of plain string checksums (the save gather), and written again.
    joined = ChunkTable.concat([table, ChunkTable.from_chunks(MIXED)])
    assert joined == chunks + MIXED
    again, _ = decode_manifest(encode_manifest(table, {"step": 1}))
    assert again == chunks


def test_null_file_headers_read_as_no_header():
    chunks = sample()[:2]
    rows = {n: [c.to_row()[n] for c in chunks] for n in MANIFEST_SCHEMA.names}
    rows["file_header"] = ["crc32:h", None]
    table = ChunkTable.from_arrow(pa.Table.from_pydict(rows, schema=MANIFEST_SCHEMA))
    assert [c.file_header for c in table] == ["crc32:h", ""]
    assert list(table) == [chunks[0], Chunk(**{**chunks[1].__dict__, "file_header": ""})]


def test_an_empty_manifest_decodes_to_an_empty_table():
    table, _ = decode_manifest(encode_manifest([], {"step": 1}))
    assert len(table) == 0 and list(table) == [] and table.width == 1
    assert table.file_counts() == {} and table.kinds() == set() and table.file_extents() == {}
    plain = ChunkTable.from_arrow(MANIFEST_SCHEMA.empty_table())
    assert len(plain) == 0 and plain.width == 1 and plain.file_counts() == {}


def test_a_table_of_vectors_only_is_one_column_wide():
    chunks = [_chunk("v", "param", 6, 0, 2, "f", 0), _chunk("v", "param", 6, 2, 4, "f", 8)]
    table, _ = decode_manifest(encode_manifest(chunks, {"step": 1}))
    assert table.width == 1 and list(table) == chunks


def test_scalars_alone_and_after_a_vector_decode():
    scalar = Chunk("s", "param", "float32", (), (), (), "f", 0, 4, "crc32:00000000")
    vector = _chunk("v", "param", 3, 0, 3, "f", 4)
    for chunks in ([scalar], [scalar, dataclasses.replace(scalar, name="t", byte_start=4, byte_end=8)], [vector, scalar]):
        table, _ = decode_manifest(encode_manifest(chunks, {"step": 1}))
        assert list(table) == chunks
        check_chunks_disjoint_and_complete(table)


def test_a_sliced_arrow_table_decodes_to_its_rows():
    chunks = sample()
    arrow = pa.Table.from_pydict({n: [c.to_row()[n] for c in chunks] for n in MANIFEST_SCHEMA.names}, schema=MANIFEST_SCHEMA)
    assert list(ChunkTable.from_arrow(arrow.slice(2, 5))) == chunks[2:7]
    assert list(ChunkTable.from_arrow(arrow.slice(9))) == chunks[9:]


def test_a_decoded_vector_overlap_next_to_a_matrix_is_found():
    # v: [0, 3) and [2, 5) of 6 elements: 6 held, 6 needed, so only the overlap test can tell; the
    # vector's rows sit in a table two columns wide (m is 6 x 1), read from Parquet list columns.
    chunks = ([_chunk("v", "param", 6, 0, 3, "f", 0), _chunk("v", "param", 6, 2, 3, "f", 12)]
              + grid(name="m", rows=6, cols=1, row_cuts=(0, 2), col_cuts=(0,), file="g"))
    table, _ = decode_manifest(encode_manifest(chunks, {"step": 1}))
    with pytest.raises(CheckpointError) as raised:
        check_chunks_disjoint_and_complete(table)
    assert str(raised.value) == "v (param): chunks at (0,) and (2,) overlap"


def test_a_damaged_manifest_with_short_offsets_is_refused_by_the_check():
    # The offsets and sizes lists name one dim of a 2-d tensor: box columns of different widths.
    # (Reading such a manifest refuses it sooner: tests/unit/test_manifest_rows.py.)
    chunks = [Chunk("w", "param", "float32", (4, 2), (0,), (4,), "f", 0, 32, "crc32:00000000")]
    table = ChunkTable.from_chunks(chunks)
    assert list(table) == chunks and table.width == 2
    with pytest.raises(CheckpointError) as raised:
        check_chunks_disjoint_and_complete(table)
    assert str(raised.value) == "w (param): chunk at (0,) size (4,) lies outside the global shape (4, 2)"


def test_equality_and_indexing_at_the_ends():
    table = ChunkTable.from_chunks(MIXED)
    assert table != MIXED[::-1] and table != ChunkTable.from_chunks(MIXED[1:] + MIXED[:1])  # same length, other records
    assert table[0] == MIXED[0] and table[4] == MIXED[4] and table[-5] == MIXED[0]
    for index in (5, 9):
        with pytest.raises(IndexError) as raised:
            table[index]
        assert raised.value.args == (index,)
    with pytest.raises(IndexError):
        table[-6]


def test_a_pickled_table_keeps_its_width_and_columns():
    import pickle

    for chunks in (sample(), MIXED, grid(name="t", rows=2, cols=2, row_cuts=(0,), col_cuts=(0,)) + [
            Chunk("c", "param", "float32", (2, 2, 2), (0, 0, 0), (2, 2, 2), "h", 0, 32, "crc32:0")]):
        table = ChunkTable.from_chunks(chunks)
        again = pickle.loads(pickle.dumps(table))
        assert again == chunks and again.width == table.width
        assert {name: again.boxes[name].tolist() for name in again.boxes} == {name: table.boxes[name].tolist() for name in table.boxes}
        assert decode_manifest(encode_manifest(again, {"step": 1}))[0] == chunks


def test_concat_of_two_tables_and_of_empty_ones():
    assert ChunkTable.concat([ChunkTable.from_chunks(MIXED[:3]), ChunkTable.from_chunks(MIXED[3:])]) == MIXED
    assert ChunkTable.concat([ChunkTable.from_chunks(MIXED[:1]), ChunkTable.from_chunks([]),
                              ChunkTable.from_chunks(MIXED[1:])]) == MIXED
    empty = ChunkTable.concat([ChunkTable.from_chunks([]), ChunkTable.from_chunks([])])
    assert len(empty) == 0 and list(empty) == []


def test_header_checks_as_a_mapping():
    # f: headers recorded, first chunk at 100; g: none recorded; h: header recorded, first chunk at 0
    # (an empty header range); k: another header, no empty header anywhere in the second table.
    chunks = grid(file="f") + grid(name="u", kind="param", file="g", header="") + [
        Chunk("z", "param", "float32", (2,), (0,), (2,), "h", 0, 8, "crc32:0", "crc32:z")]
    headers = header_checks(chunks)
    assert list(headers) == ["f", "h"] and len(headers) == 2 and "g" not in headers and "h" in headers
    assert (headers["h"].byte_start, headers["h"].byte_end, headers["h"].checksum) == (0, 0, "crc32:z")
    with pytest.raises(KeyError) as raised:
        headers["g"]
    assert raised.value.args == ("g",)
    assert headers.get("nowhere") is None
    # Per file code (f, g, h): the first chunk's start, -1 where no header is recorded.
    assert headers.first_chunk_starts().tolist() == [100, -1, 0]
    # No chunk without a header: every file is checked, whatever its header's dictionary code.
    both = header_checks(grid(file="f", header="crc32:a") + grid(name="u", file="k", header="crc32:b"))
    assert list(both) == ["f", "k"] and both["k"].checksum == "crc32:b" and both["k"].byte_end == 100


def test_volumes_count_only_each_rows_own_sizes():
    # A table two columns wide: a 3 x 4 chunk, a 5-element vector (padding column 0) and a scalar
    # (both columns padding): 12, 5 and 1 elements, one int64 per row.
    chunks = [Chunk("m", "param", "float32", (6, 4), (3, 0), (3, 4), "f", 0, 48, "crc32:0"),
              Chunk("v", "param", "float32", (7,), (2,), (5,), "f", 48, 68, "crc32:1"),
              Chunk("s", "param", "float32", (), (), (), "f", 68, 72, "crc32:2")]
    table = ChunkTable.from_chunks(chunks)
    assert table.width == 2
    volumes = table.volumes()
    assert volumes.tolist() == [12, 5, 1] and volumes.shape == (3,)


def test_tensor_keys_name_each_name_and_kind_as_the_layout_planner_searches_them():
    # MIXED: names a=0, b=1; kinds param=0, exp_avg=1 (two kinds): key = name * 2 + kind, the
    # formula `layout_plan._SourceRows.segments` rebuilds from the target's names and kinds.
    table = ChunkTable.from_chunks(MIXED)
    keys = table.tensor_keys()
    assert keys.tolist() == [0, 2, 0, 1, 2] and keys.dtype == np.int64
    # One kind only: key = name code * 1.
    single = ChunkTable.from_chunks([_chunk("p", "param", 4, 0, 4, "f", 0), _chunk("q", "param", 4, 0, 4, "f", 16),
                                     _chunk("r", "param", 2, 0, 2, "f", 32)])
    assert single.tensor_keys().tolist() == [0, 1, 2]


def test_code_of_a_value_and_of_one_absent_from_the_column():
    table = ChunkTable.from_chunks(MIXED)  # files in first-listed order: z, y, x; names a, b
    assert [table.code("file", f) for f in ("z", "y", "x")] == [0, 1, 2]
    assert table.code("file", "w") is None and table.code("name", "b") == 1 and table.code("kind", "exp_avg") == 1
    assert table.code("file", "x") == 2  # asked again: the same answer


def test_as_table_makes_a_table_of_records_and_keeps_a_table():
    table = as_table(MIXED)
    assert isinstance(table, ChunkTable) and list(table) == MIXED
    assert as_table(table) is table
    assert isinstance(as_table(iter(MIXED[:2])), ChunkTable) and as_table(iter(MIXED[:2])) == MIXED[:2]


# sample()'s fourth record, worked by hand: grid() lists column blocks, then row blocks; [0, 3) x [0, 4)
# at 100 (48 bytes), [3, 7) x [0, 4) at 148 (64), [7, 10) x [0, 4) at 212 (48), then [0, 3) x [4, 6) at 260 (24).
FOURTH = Chunk("w", "param", "float32", (10, 6), (0, 4), (3, 2), "f", 260, 284, "crc32:00000104", "crc32:h")
LAST = Chunk("norm", "param", "float32", (6,), (0,), (6,), "g", 7, 31, "crc32:0000000n", "")


def test_one_record_of_a_decoded_table_is_made_alone():
    # A row asked for alone, before any other (1 of 13 rows: its checksum taken from the Arrow column).
    decoded, _ = decode_manifest(encode_manifest(sample(), {"step": 1}))
    assert decoded[3] == FOURTH and decoded[3].checksum == "crc32:00000104"
    assert decoded.chunks_at(np.array([12])) == [LAST]
    assert decoded[3] is decoded.chunks_at(np.array([3]))[0]  # made once, then kept


def test_one_record_of_an_unpickled_table_is_made_alone():
    import pickle

    again = pickle.loads(pickle.dumps(ChunkTable.from_chunks(sample())))  # checksums as fixed-width bytes
    assert again[3] == FOURTH and again[-1] == LAST
    assert type(again[3].checksum) is str and type(again[3].byte_start) is int


def test_a_table_of_records_is_as_wide_as_its_longest_box():
    vectors = [_chunk("v", "param", 6, 0, 2, "f", 0), _chunk("v", "param", 6, 2, 4, "f", 8)]
    scalar = Chunk("s", "param", "float32", (), (), (), "f", 0, 4, "crc32:00000000")
    assert ChunkTable.from_chunks(vectors).width == 1
    assert ChunkTable.from_chunks([scalar]).width == 1 and ChunkTable.from_chunks([]).width == 1
    assert ChunkTable.from_chunks(vectors + [FOURTH]).width == 2


def test_a_table_of_records_keeps_int64_byte_ranges():
    table = ChunkTable.from_chunks(MIXED)
    assert table.byte_start.dtype == np.int64 and table.byte_end.dtype == np.int64
    assert table.byte_start.tolist() == [0, 0, 16, 4, 8] and table.byte_end.tolist() == [8, 16, 24, 12, 40]
    # Joined (the save gather), the records are made from the columns: ints, not floats.
    joined = ChunkTable.concat([ChunkTable.from_chunks(MIXED[:2]), ChunkTable.from_chunks(MIXED[2:])])
    assert joined == MIXED and _fields_are_ints(joined)


def test_decoded_boxes_are_padded_with_zeros():
    # A 3 x 4 chunk, a 5-element vector and a scalar, decoded from Parquet list columns: each row's
    # own values, then zeros to the table's width of 2.
    chunks = [Chunk("m", "param", "float32", (6, 4), (3, 0), (3, 4), "f", 0, 48, "crc32:0"),
              Chunk("v", "param", "float32", (7,), (2,), (5,), "f", 48, 68, "crc32:1"),
              Chunk("s", "param", "float32", (), (), (), "f", 68, 72, "crc32:2")]
    decoded, _ = decode_manifest(encode_manifest(chunks, {"step": 1}))
    assert decoded.boxes["global_shape"].tolist() == [[6, 4], [7, 0], [0, 0]]
    assert decoded.boxes["offsets"].tolist() == [[3, 0], [2, 0], [0, 0]]
    assert decoded.boxes["sizes"].tolist() == [[3, 4], [5, 0], [0, 0]]
    assert decoded.volumes().tolist() == [12, 5, 1] and list(decoded) == chunks


def test_a_header_check_is_made_once_per_file():
    headers = header_checks(grid(file="f") + grid(name="u", file="k", header="crc32:b"))
    assert headers["k"] is headers["k"] and headers["f"] is headers["f"] and headers["f"] is not headers["k"]


def test_shapes_and_byte_ranges_past_2_to_the_53_are_exact():
    # 2**53 + 1 and its neighbours have no float64 of their own: every column stays int64.
    big = 2**53 + 1
    chunks = [Chunk("w", "param", "float32", (big,), (big - 3,), (3,), "f", big, big + 12, "crc32:0")]
    decoded, _ = decode_manifest(encode_manifest(chunks, {"step": 1}))
    assert list(decoded) == chunks and decoded[0].global_shape == (9007199254740993,)
    assert decoded.file_extents() == {"f": 9007199254741005}
    assert ChunkTable.from_chunks(chunks).file_extents() == {"f": 9007199254741005}
