"""Writing a rank's pieces as one safetensors file, streamed: the header from shapes first, then
each piece in row blocks.

No pickle: tensors go through safetensors. Memory: each piece is streamed in row blocks of at most
STAGE_BYTES (a device tensor is copied to CPU one block at a time; a CPU tensor is written straight
from its own memory), so the extra memory of a save is one block plus the file system's write
buffer, whatever the shard size.
"""
from __future__ import annotations

import io
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rayshard.storage.checksums import RunningChecksum, checksum
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.manifest.codec import FORMAT_VERSION, chunk_key
from rayshard.plans.checkpoint.safetensors_layout import Entry, file_layout
from rayshard.plans.errors import CheckpointError
from rayshard.storage.backends.registry import backend_for

STAGE_BYTES = 16 * 2**20


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class LazyTensor:
    """A piece whose bytes are produced only when the writer reaches it (the offline reshard reads
    each piece just before writing it, so one piece at a time is in memory)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of a global tensor to write: the rank's local part (`tensor`, or a LazyTensor)
    of tensor `name`'s state `kind`, whose global shape is `global_shape` and which starts at
    `offsets` in it."""

    name: str
    kind: str
    tensor: torch.Tensor | LazyTensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def _byte_blocks(tensor: torch.Tensor, stage_bytes: int):
    """The tensor's row-major bytes as CPU buffers of at most ~stage_bytes (whole rows each)."""
    tensor = tensor.detach()
    if tensor.dim() == 0 or tensor.numel() == 0:
        yield tensor.reshape(-1).to("cpu").contiguous().view(torch.uint8).numpy().data
        return
    row_bytes = max(1, tensor[0].numel() * tensor.element_size())
    rows_per_block = max(1, stage_bytes // row_bytes)
    for start in range(0, tensor.shape[0], rows_per_block):
        block = tensor[start:start + rows_per_block]
        # On CPU a contiguous block is written from the parameter's own memory (no copy): the save
        # runs between steps, so nothing changes it meanwhile. A device block is staged to CPU.
        block = block.to("cpu").contiguous()
        yield block.reshape(-1).view(torch.uint8).numpy().data


def write_pieces(handle, pieces: Sequence[Piece], file: str, stage_bytes: int = STAGE_BYTES) -> list[Chunk]:
    """Stream pieces into an open binary handle as one safetensors file; return one Chunk per
    piece with its absolute byte range."""
    entries = [Entry(chunk_key(p.name, p.kind, p.offsets), dtype_name(p.tensor.dtype), tuple(p.tensor.shape))
               for p in pieces]  # a LazyTensor has dtype and shape too
    # The nonce makes every written header unique, so a manifest can tell its own file from a
    # replacement even when it reads only part of a chunk.
    header, ranges = file_layout(entries, {"format": "rayshard", "version": FORMAT_VERSION, "nonce": uuid.uuid4().hex})
    handle.write(header)
    header_checksum = checksum(header)
    chunks = []
    # A writer that can keep a block by reference (the snapshot keepers', which copies the file
    # once into Ray's object store) is given the blocks themselves: nothing changes them before
    # the writer closes (staged copies, parameters between steps, or fresh per-block copies).
    write_block = getattr(handle, "write_kept", handle.write)
    for piece, entry, (start, end) in zip(pieces, entries, ranges):
        name, kind, tensor = piece.name, piece.kind, piece.tensor
        running, written = RunningChecksum(), 0
        if isinstance(tensor, LazyTensor):
            tensor = tensor.load()
        for block in _byte_blocks(tensor, stage_bytes):
            write_block(block)
            running.update(block)
            written += len(block)
        if written != end - start:
            raise CheckpointError(f"{name} ({kind}): wrote {written} bytes but its header entry needs {end - start}")
        chunks.append(Chunk(name, kind, entry.dtype, tuple(piece.global_shape), tuple(piece.offsets), entry.shape, file, start, end,
                            running.text(), header_checksum))
    return chunks


def write_shard(fs, base: str, file: str, pieces: Sequence[Piece], stage_bytes: int = STAGE_BYTES) -> list[Chunk]:
    """Write pieces to base/file on an fsspec file system, streaming."""
    path = f"{base}/{file}"
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with backend_for(fs).open_writer(path) as handle:  # S3: parallel multipart, bounded memory, stall bound
        return write_pieces(handle, pieces, file, stage_bytes)


def encode_shard(pieces: Sequence[Piece], file: str) -> tuple[bytes, list[Chunk]]:
    """The same file in memory (tests, small tools)."""
    sink = io.BytesIO()
    chunks = write_pieces(sink, pieces, file)
    return sink.getvalue(), chunks
