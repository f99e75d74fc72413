"""The manifest: the Parquet table that lists every chunk of a checkpoint, and its codec.

Written last, it is the commit (docs/checkpoint-format.md). Pure: bytes in, records out; it imports
neither torch nor Ray, so catalog commands (`ckpt ls`, `ckpt show`) stay light.
"""
from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.manifest.rows import check_manifest_rows
from rayshard.plans.errors import CheckpointError

# The manifest's object name inside a checkpoint directory.
MANIFEST = "manifest.parquet"
# 2.0: chunk and header checksums are CRC32C (1.x: CRC32); a 1.x reader refuses 2.0 by its major
# version rather than report every chunk corrupt. 2.1: CRC32 again, computed by ISA-L (any reader
# that knows CRC32 verifies it, so a minor version; storage/checksums.py).
FORMAT_VERSION = "2.1"
READABLE_MAJORS = ("1", "2")
METADATA_KEY = b"rayshard"
MANIFEST_SCHEMA = pa.schema([
    ("name", pa.string()),
    ("kind", pa.string()),
    ("dtype", pa.string()),
    ("global_shape", pa.list_(pa.int64())),
    ("offsets", pa.list_(pa.int64())),
    ("sizes", pa.list_(pa.int64())),
    ("file", pa.string()),
    ("byte_start", pa.int64()),
    ("byte_end", pa.int64()),
    ("checksum", pa.string()),
    ("file_header", pa.string()),
])
# Read as dictionaries: few distinct values, one per row otherwise.
DICTIONARY_COLUMNS = ("name", "kind", "dtype", "file", "file_header")


def chunk_key(name: str, kind: str, offsets: Sequence[int]) -> str:
    """The tensor's key inside its safetensors file (unique per file, readable by any safetensors tool)."""
    return f"{kind}/{name}@{','.join(map(str, offsets))}"


def encode_manifest(chunks: list[Chunk] | ChunkTable, metadata: dict) -> bytes:
    if isinstance(chunks, ChunkTable):  # columns already: the gather of a large save
        table = chunks.to_arrow(MANIFEST_SCHEMA)
    else:
        # Column by column: a dict per row (dataclasses.asdict) cost ~15 us a chunk, 4-6 ms a commit
        # on the presets (1 ms now).
        table = pa.Table.from_pydict({name: [getattr(chunk, name) for chunk in chunks] for name in MANIFEST_SCHEMA.names},
                                     schema=MANIFEST_SCHEMA)
    document = dict(metadata, format_version=FORMAT_VERSION)
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(document, sort_keys=True).encode()})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def decode_manifest(data: bytes, where: str = "manifest") -> tuple[ChunkTable, dict]:
    """The chunks, as columns (`ChunkTable`: a Sequence of `Chunk` that makes records only for the
    rows asked for), and the run metadata. String columns are read dictionary-encoded, so each
    distinct name, kind, dtype and file is one Python string however many chunks name it."""
    try:
        # Threads only cost on the presets' small manifests; a 16k-rank one (826k rows) decodes in
        # well under a second on one.
        present = set(pq.ParquetFile(pa.BufferReader(data)).schema_arrow.names)  # format 1.0 has no file_header
        table = pq.ParquetFile(pa.BufferReader(data), read_dictionary=[c for c in DICTIONARY_COLUMNS if c in present]
                               ).read(use_threads=False)
    except Exception as error:  # pyarrow raises several types for damaged files
        raise CheckpointError(f"{where}: not a readable Parquet manifest ({error})") from error
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise CheckpointError(f"{where}: Parquet file has no rayshard metadata; it is not a rayshard manifest")
    try:
        metadata = json.loads(raw)
    except ValueError as error:  # bad JSON or bad UTF-8
        raise CheckpointError(f"{where}: its rayshard metadata is not valid JSON ({error}): the manifest is damaged. "
                              "Fix: resume from another checkpoint") from None
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{where}: its rayshard metadata is a JSON {type(metadata).__name__}, not an object: the "
                              "manifest is damaged. Fix: resume from another checkpoint")
    version = str(metadata.get("format_version", ""))
    if not re.fullmatch(r"\d+\.\d+", version):
        raise CheckpointError(f"{where}: its format_version {version!r} is not MAJOR.MINOR: the manifest is damaged or "
                              "was not written by rayshard. Fix: resume from another checkpoint")
    if version.split(".")[0] not in READABLE_MAJORS:
        raise CheckpointError(f"{where}: format version {version} is not readable by this rayshard "
                              f"(reads {', '.join(m + '.x' for m in READABLE_MAJORS)}); upgrade rayshard to read it")
    required = [name for name in MANIFEST_SCHEMA.names if name != "file_header"]  # absent in format 1.0
    damaged = [name for name in required if name not in table.column_names or table.column(name).null_count]
    if damaged:
        raise CheckpointError(f"{where}: the manifest's column(s) {', '.join(damaged)} are missing or hold nulls; "
                              "it is damaged. Fix: resume from another checkpoint")
    mistyped = [f"{field.name} ({table.schema.field(field.name).type}, not {field.type})" for field in MANIFEST_SCHEMA
                if field.name in table.column_names and not _same_type(table.schema.field(field.name).type, field.type)]
    if mistyped:
        raise CheckpointError(f"{where}: the manifest's column(s) {', '.join(mistyped)} have the wrong type; it is "
                              "damaged. Fix: resume from another checkpoint")
    check_manifest_rows(table, where)
    return ChunkTable.from_arrow(table), metadata


def _same_type(found: pa.DataType, expected: pa.DataType) -> bool:
    """A column's type as the schema says, string columns also as read dictionary-encoded."""
    if pa.types.is_dictionary(found):
        found = found.value_type
    return found == expected
