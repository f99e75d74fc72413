"""A checkpoint chunk: one contiguous piece of one global tensor, stored in one file.

Chunks are layout-free: they say which global tensor, which region (offsets and sizes in the
global shape), and where the bytes are — never which rank or layout wrote them.
"""
from __future__ import annotations

import math

from dataclasses import asdict, dataclass

from rayshard.plans.checkpoint.safetensors_layout import ITEMSIZE as DTYPE_SIZES

# Kinds of state a chunk can hold; optimizer moments share their parameter's name and region.
PARAM = "param"
EXP_AVG = "exp_avg"
EXP_AVG_SQ = "exp_avg_sq"
STATE_KINDS = (PARAM, EXP_AVG, EXP_AVG_SQ)


@dataclass(frozen=True)
class Chunk:
    name: str
    kind: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint directory
    byte_start: int
    byte_end: int
    checksum: str  # "crc32:xxxxxxxx" of bytes [byte_start, byte_end) ("crc32c:" in format 2.0)
    # The same checksum of the file's safetensors header (bytes before its first chunk), which holds a
    # nonce unique to the write: a reader detects a replaced or rewritten file even when it reads
    # only part of a chunk. Empty in format 1.0 manifests.
    file_header: str = ""

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    def to_row(self) -> dict:
        row = asdict(self)
        for key in ("global_shape", "offsets", "sizes"):
            row[key] = list(row[key])
        return row

    @classmethod
    def from_row(cls, row: "dict | Chunk") -> "Chunk":
        """A chunk from its manifest row; a `Chunk` (what iterating a `ChunkTable` of rows gives) as is."""
        if isinstance(row, Chunk):
            return row
        values = dict(row)
        for key in ("global_shape", "offsets", "sizes"):
            values[key] = tuple(int(v) for v in values[key])
        return cls(**{k: values[k] for k in cls.__dataclass_fields__ if k in values and values[k] is not None})
