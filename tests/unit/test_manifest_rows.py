"""A manifest that parses but says something impossible is refused as it is read, naming the
chunk and the fault, instead of failing far away (a KeyError on a dtype, an IndexError planning
a load) or reading the wrong bytes."""
import dataclasses
import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayshard.storage.manifest_io import read_manifest
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.manifest.codec import MANIFEST, METADATA_KEY, decode_manifest, encode_manifest
from rayshard.plans.errors import CheckpointError

# A 2-d weight in two row blocks, a bf16 vector and a 0-d counter: asymmetric, every rank of shape.
GOOD = [
    Chunk("w", "param", "float32", (5, 3), (0, 0), (2, 3), "rank-0", 0, 24, "crc32:0", ""),
    Chunk("w", "param", "float32", (5, 3), (2, 0), (3, 3), "rank-1", 0, 36, "crc32:1", ""),
    Chunk("b", "exp_avg", "bfloat16", (7,), (0,), (7,), "rank-0", 24, 38, "crc32:2", ""),
    Chunk("step", "counter", "int64", (), (), (), "rank-1", 36, 44, "crc32:3", ""),
]


def _with(index: int, **changes) -> list[Chunk]:
    chunks = list(GOOD)
    chunks[index] = dataclasses.replace(chunks[index], **changes)
    return chunks


def test_a_sound_manifest_reads_back_whole():
    table, metadata = decode_manifest(encode_manifest(GOOD, {"step": 3}))
    assert list(table) == GOOD and metadata["step"] == 3


@pytest.mark.parametrize("chunks, fragment", [
    (_with(2, dtype="float8"), "chunk 2 (exp_avg b in rank-0): dtype 'float8' is not one rayshard writes"),
    (_with(0, offsets=(0,)), "chunk 0 (param w in rank-0): its offsets and global_shape differ in length"),
    (_with(1, sizes=(3, 3, 1)), "chunk 1 (param w in rank-1): its sizes and global_shape differ in length"),
    (_with(0, byte_end=28), "chunk 0 (param w in rank-0): its bytes [0, 28) do not hold its 6 element(s) of 4 byte(s)"),
    (_with(3, byte_start=40), "chunk 3 (counter step in rank-1): its bytes [40, 44) do not hold its 1 element(s) of 8"),
    (_with(2, byte_start=-2, byte_end=12), "chunk 2 (exp_avg b in rank-0): its bytes [-2, 12)"),
])
def test_an_impossible_row_is_named(chunks, fragment):
    with pytest.raises(CheckpointError) as raised:
        decode_manifest(encode_manifest(chunks, {"step": 3}), "ckpt/manifest.parquet")
    assert str(raised.value).startswith("ckpt/manifest.parquet: ")
    assert fragment in str(raised.value) and "Fix: " in str(raised.value)


def _with_metadata(raw: bytes) -> bytes:
    table = pq.read_table(pa.BufferReader(encode_manifest(GOOD, {"step": 3})))
    sink = pa.BufferOutputStream()
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: raw}), sink)
    return sink.getvalue().to_pybytes()


@pytest.mark.parametrize("raw, fragment", [
    (b"{'step': 3}", "its rayshard metadata is not valid JSON"),
    (b"\xff\xfe", "its rayshard metadata is not valid JSON"),
    (json.dumps([1, 2]).encode(), "its rayshard metadata is a JSON list, not an object"),
])
def test_damaged_run_metadata_is_named(raw, fragment):
    with pytest.raises(CheckpointError, match="Fix: resume from another checkpoint") as raised:
        decode_manifest(_with_metadata(raw), "m")
    assert fragment in str(raised.value)


def test_a_checkpoint_whose_manifest_lists_nothing_is_refused(tmp_path):
    (tmp_path / MANIFEST).write_bytes(encode_manifest([], {"step": 3}))
    with pytest.raises(CheckpointError, match="the manifest lists no chunks"):
        read_manifest(str(tmp_path))


def test_a_large_sound_manifest_passes_the_checks_whole():
    """200k rows (a 16k-rank save's order of size) pass every vectorised check and decode whole;
    the time is printed for the log, never asserted."""
    rows = 200_000
    chunks = [Chunk(f"layers.{i % 500}.w", "param", "float32", (6400, 64), (16 * (i // 500), 0), (16, 64),
                    f"rank-{i % 16384:05d}", 0, 16 * 64 * 4, "crc32:0", "") for i in range(rows)]
    data = encode_manifest(chunks, {"step": 1})
    started = time.perf_counter()
    table, _ = decode_manifest(data)
    print(f"decoded and checked {rows} rows in {time.perf_counter() - started:.3f} s")
    assert len(table) == rows and np.array_equal(table.byte_end[:3], [4096] * 3)


def test_a_column_of_the_wrong_type_is_named():
    table = pq.read_table(pa.BufferReader(encode_manifest(GOOD, {"step": 3})))
    index = table.column_names.index("byte_start")
    as_text = table.set_column(index, "byte_start", pa.array([str(v) for v in table.column("byte_start").to_pylist()]))
    sink = pa.BufferOutputStream()
    pq.write_table(as_text, sink)
    with pytest.raises(CheckpointError, match=r"column\(s\) byte_start \(string, not int64\) have the wrong type"):
        decode_manifest(sink.getvalue().to_pybytes(), "m")
