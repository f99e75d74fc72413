"""Checkpoint bytes: a rank's chunks in a safetensors file, the Parquet manifest, ranged reads.

No pickle anywhere: tensors go through safetensors, metadata through Parquet and JSON.
"""
from __future__ import annotations

import io
import json
import struct
import zlib

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save as safetensors_bytes

from plans.chunks import Chunk
from plans.errors import CheckpointError
from plans.reshard import ReadItem

FORMAT_VERSION = "1.0"
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
])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checksum(data) -> str:
    return f"crc32:{zlib.crc32(data):08x}"


def _staged(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy that owns its memory: safetensors refuses tensors that share storage, and the
    copy also decouples the bytes being written from training that continues to update them."""
    tensor = tensor.detach()
    return tensor.to("cpu", copy=True).contiguous() if tensor.device.type == "cpu" else tensor.cpu().contiguous()


def encode_shard(pieces: list[tuple[str, str, torch.Tensor, tuple, tuple]], file: str) -> tuple[bytes, list[Chunk]]:
    """pieces: (name, kind, local tensor, global shape, global offsets). Returns the safetensors
    bytes and one Chunk per piece with its absolute byte range inside the file."""
    tensors = {f"{kind}/{name}@{','.join(map(str, offsets))}": _staged(tensor) for name, kind, tensor, _, offsets in pieces}
    data = safetensors_bytes(tensors, metadata={"format": "rayshard", "version": FORMAT_VERSION})
    header_len = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + header_len])
    base = 8 + header_len
    chunks = []
    view = memoryview(data)
    for (name, kind, tensor, shape, offsets), key in zip(pieces, tensors):
        begin, end = header[key]["data_offsets"]
        start, stop = base + begin, base + end
        chunks.append(Chunk(name, kind, dtype_name(tensor.dtype), tuple(shape), tuple(offsets),
                            tuple(tensor.shape), file, start, stop, checksum(view[start:stop])))
    return data, chunks


def encode_manifest(chunks: list[Chunk], metadata: dict) -> bytes:
    table = pa.Table.from_pylist([c.to_row() for c in chunks], schema=MANIFEST_SCHEMA)
    document = dict(metadata, format_version=FORMAT_VERSION)
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(document, sort_keys=True).encode()})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def decode_manifest(data: bytes, where: str = "manifest") -> tuple[list[Chunk], dict]:
    try:
        table = pq.read_table(io.BytesIO(data))
    except Exception as error:  # pyarrow raises several types for damaged files
        raise CheckpointError(f"{where}: not a readable Parquet manifest ({error})") from error
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise CheckpointError(f"{where}: Parquet file has no rayshard metadata; it is not a rayshard manifest")
    metadata = json.loads(raw)
    version = str(metadata.get("format_version", "?"))
    if version.split(".")[0] != FORMAT_VERSION.split(".")[0]:
        raise CheckpointError(f"{where}: format version {version} is not readable by this rayshard "
                              f"(reads {FORMAT_VERSION.split('.')[0]}.x); upgrade rayshard to read it")
    return [Chunk.from_row(row) for row in table.to_pylist()], metadata


def fill_from_reads(fs, base: str, items: list[ReadItem], target: torch.Tensor, target_offsets: tuple[int, ...]) -> int:
    """Fetch every item's byte range (one batched call), copy the intersections into target.
    Returns bytes read."""
    if not items:
        return 0
    paths = [f"{base}/{item.chunk.file}" for item in items]
    blobs = fs.cat_ranges(paths, [i.byte_start for i in items], [i.byte_end for i in items], on_error="return")
    for item, blob, path in zip(items, blobs, paths):
        if isinstance(blob, BaseException) or len(blob) != item.nbytes:
            got = "an error: " + str(blob) if isinstance(blob, BaseException) else f"{len(blob)} bytes"
            raise CheckpointError(f"{path}: expected bytes [{item.byte_start}, {item.byte_end}) of "
                                  f"{item.chunk.name} ({item.chunk.kind}) but got {got}; the shard is missing or truncated")
        if (item.byte_start, item.byte_end) == (item.chunk.byte_start, item.chunk.byte_end) and checksum(blob) != item.chunk.checksum:
            raise CheckpointError(f"{path}: checksum mismatch for {item.chunk.name} ({item.chunk.kind}) "
                                  f"at bytes [{item.byte_start}, {item.byte_end}); the file changed or is corrupt")
        chunk = item.chunk
        dtype = getattr(torch, chunk.dtype)
        rows = torch.frombuffer(bytearray(blob), dtype=dtype)
        rows = rows.view((item.rows[1] - item.rows[0], *chunk.sizes[1:]) if chunk.sizes else ())
        source = tuple(slice(o - c, o - c + s) for o, c, s in zip(item.offsets[1:], chunk.offsets[1:], item.sizes[1:]))
        destination = tuple(slice(o - t, o - t + s) for o, t, s in zip(item.offsets, target_offsets, item.sizes))
        piece = rows[(slice(None), *source)] if chunk.sizes else rows
        if piece.dtype != target.dtype:
            raise CheckpointError(f"{chunk.name} ({chunk.kind}): stored as {chunk.dtype}, model expects {dtype_name(target.dtype)}")
        target[destination].copy_(piece)
    return sum(item.nbytes for item in items)
