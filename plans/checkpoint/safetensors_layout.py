"""The byte layout of a safetensors file, computed before any tensor is touched.

A safetensors file is an 8-byte little-endian header length, a JSON header naming every tensor's
dtype, shape and [begin, end) data offsets, then the raw little-endian bytes back to back. Knowing
every shape up front fixes all of it, so a writer can emit the header first and then stream the
tensors one by one (bounded memory), and a planner can predict every chunk's byte range for a
checkpoint that was never written (`bench/plan_scale.py`).
"""
from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from rayshard.plans.errors import CheckpointError

# rayshard dtype name (torch's, without "torch.") -> safetensors dtype tag, and bytes per element.
SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                      "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
DTYPE_NAMES = {tag: name for name, tag in SAFETENSORS_DTYPES.items()}
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
            "int8": 1, "uint8": 1, "bool": 1}
HEADER_ALIGNMENT = 8  # the reference writer pads the header so data starts 8-byte aligned


@dataclass(frozen=True)
class Entry:
    key: str
    dtype: str  # rayshard/torch dtype name, e.g. "float32"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = ITEMSIZE[self.dtype]
        for size in self.shape:
            count *= size
        return count


def file_layout(entries: Sequence[Entry], metadata: dict[str, str] | None = None) -> tuple[bytes, list[tuple[int, int]]]:
    """(header bytes including the length prefix, absolute [start, end) of each entry's data)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    position = 0
    relative = []
    for entry in entries:
        if entry.dtype not in SAFETENSORS_DTYPES:
            raise CheckpointError(f"{entry.key}: dtype {entry.dtype} cannot be stored in safetensors "
                                  f"(supported: {', '.join(SAFETENSORS_DTYPES)})")
        if entry.key in header:
            raise CheckpointError(f"{entry.key}: written twice into one safetensors file")
        end = position + entry.nbytes
        header[entry.key] = {"dtype": SAFETENSORS_DTYPES[entry.dtype], "shape": list(entry.shape),
                             "data_offsets": [position, end]}
        relative.append((position, end))
        position = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % HEADER_ALIGNMENT)
    prefix = struct.pack("<Q", len(text)) + text
    base = len(prefix)
    return prefix, [(base + start, base + end) for start, end in relative]


def parse_header(head: bytes, where: str) -> tuple[dict, int]:
    """(header dict, absolute byte where data starts) from the first bytes of a safetensors file."""
    if len(head) < 8:
        raise CheckpointError(f"{where}: {len(head)} bytes is too short for a safetensors file; it is truncated")
    (length,) = struct.unpack("<Q", head[:8])
    if len(head) < 8 + length:
        raise CheckpointError(f"{where}: header needs bytes [8, {8 + length}) but only {len(head)} were read; "
                              "the file is truncated or not safetensors")
    try:
        header = json.loads(head[8:8 + length])
    except ValueError as error:
        raise CheckpointError(f"{where}: the safetensors header is not valid JSON ({error})") from None
    return header, 8 + length
