"""Executing read plans: ranged reads of stored chunks placed straight into the destination
tensors, each byte checked against its chunk's checksum while it is still in cache.

A load holds at most WINDOW_BYTES of fetched bytes that are not yet in place. Local files are read
with scatter reads (preadv) into the destinations' own memory; object stores through ranged GETs.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rayshard.storage.checksums import RunningChecksum, matches, running_like
from rayshard.storage.partial_reads import partial_read
from rayshard.storage.backends.registry import backend_for
from rayshard.storage.ranged_fetch import read_range
from rayshard.actors.checkpoint.shard_writer import STAGE_BYTES, dtype_name
from rayshard.plans.checkpoint.reshard import HeaderCheck, ReadItem, Request, coalesce
from rayshard.plans.checkpoint.safetensors_layout import SAFETENSORS_DTYPES
from rayshard.plans.errors import CheckpointError, RayshardError, StoreUnavailable, first_line

WINDOW_BYTES = 64 * 2**20


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a target's bytes land: a tensor, and where it starts in the global tensor."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]


def _short_read(path: str, start: int, end: int, what: str, got) -> RayshardError:
    """A read that did not return its bytes: the shard missing or cut short (CheckpointError), or
    the store refusing or failing the request (StoreUnavailable: a 403, a 500 after the retries, a
    timeout, which say nothing about the checkpoint and must not send anyone to restore files)."""
    if isinstance(got, BaseException) and not isinstance(got, FileNotFoundError):
        return StoreUnavailable(f"{path}: reading bytes [{start}, {end}) of {what} failed "
                                f"({type(got).__name__}: {first_line(got)}); "
                                "the store did not serve them, which says nothing about the checkpoint. Fix: check the "
                                "store's credentials, permissions and network, then run again")
    detail = ("an error: " + str(got) if isinstance(got, BaseException) else
              f"{got} bytes" if isinstance(got, int) else f"{len(got)} bytes")
    return CheckpointError(f"{path}: expected bytes [{start}, {end}) of {what} but got {detail}; "
                           "the shard is missing or truncated. Fix: restore the file, or resume from an earlier checkpoint")


def _copy_item(item: ReadItem, data, destination: Destination, path: str) -> None:
    chunk = item.chunk
    tensor, target_offsets = destination.tensor, destination.offsets
    dtype = _TORCH_DTYPES.get(chunk.dtype)
    if tensor.dtype != dtype:
        raise CheckpointError(f"{path}: {chunk.name} ({chunk.kind}) is stored as {chunk.dtype}, the model expects "
                              f"{dtype_name(tensor.dtype)}. Fix: build the model with the checkpoint's dtypes (the "
                              "run's own model config), or convert the checkpoint")
    with warnings.catch_warnings():  # read-only bytes are fine: the data is only copied out
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=dtype)
    held = flat.view(item.held_sizes) if item.held_sizes else flat.view(())
    source = tuple(slice(o - h, o - h + s) for o, h, s in zip(item.offsets, item.held_offsets, item.sizes))
    place = tuple(slice(o - t, o - t + s) for o, t, s in zip(item.offsets, target_offsets, item.sizes))
    tensor[place].copy_(held[source])


def _checksum_mismatch(item: ReadItem, path: str) -> CheckpointError:
    return CheckpointError(f"{path}: checksum mismatch for {item.chunk.name} ({item.chunk.kind}) at bytes "
                           f"[{item.byte_start}, {item.byte_end}); the file changed or is corrupt. "
                           "Fix: restore it from a copy, or resume from another checkpoint")


def _check_header(part: HeaderCheck, data, path: str) -> None:
    if not matches(part.checksum, [data], path):
        raise CheckpointError(f"{path}: its safetensors header differs from the one recorded in the manifest; "
                              "the file was replaced or rewritten after the checkpoint was committed. "
                              "Fix: restore the original file, or resume from another checkpoint")


class _Report:
    """Where a read reports each item: `served(item)` once it is verified and in place, and, when
    `partial` is a list, a PartialRead with the checksum of every item that holds only part of
    its chunk (`storage/partial_reads.py`: such parts are verified together, by whoever sees them
    all)."""

    __slots__ = ("served", "partial")

    def __init__(self, served: Callable[[ReadItem], None] | None, partial: list | None):
        self.served, self.partial = served or (lambda item: None), partial

    def running_for(self, part, path: str) -> RunningChecksum | None:
        """A checksum to feed the part's bytes to, or None when nobody needs one."""
        if isinstance(part, ReadItem) and (part.whole_chunk or self.partial is not None):
            return running_like(part.chunk.checksum, path)
        return None

    def done(self, part: ReadItem, running: RunningChecksum | None) -> None:
        if running is not None and self.partial is not None and not part.whole_chunk:
            self.partial.append(partial_read(part, running.value))
        self.served(part)


def execute_requests(fs, base: str, requests: Sequence[Request], destinations: dict[ReadItem, Destination] | Callable,
                     window_bytes: int = WINDOW_BYTES, served: Callable[[ReadItem], None] | None = None,
                     partial: list | None = None) -> int:
    """Fetch requests, verify, and copy every item into its destination. `destinations` maps an
    item to (tensor, global offsets of that tensor), or is a function doing so. Returns bytes read.
    served(item), if given, is called once each item is verified and in place. partial, if a
    list, receives a PartialRead for every item that reads only part of its chunk (which this
    read cannot verify alone).

    Local files are read item by item straight into the destination when its slice is contiguous
    (a same-layout load copies nothing twice and needs no buffer), else through one reused buffer.
    Object stores stream: GETs run concurrently with at most `window_bytes` fetched and not yet
    placed, and each is placed as it arrives (`storage/ranged_fetch.py`)."""
    lookup = destinations if callable(destinations) else destinations.__getitem__
    report = _Report(served, partial)
    backend = backend_for(fs)
    if backend.local_paths:
        return _execute_local(base, requests, lookup, report)
    total = 0
    small = [r for r in requests if r.nbytes <= window_bytes]
    with contextlib.closing(backend.fetch_ranges(base, small, window_bytes)) as arrivals:
        for request, blob in arrivals:
            path = f"{base}/{request.file}"
            if isinstance(blob, BaseException) or len(blob) != request.nbytes:
                raise _short_read(path, request.byte_start, request.byte_end, _describe(request), blob)
            _serve(request, blob, path, lookup, report)
            total += request.nbytes
    for request in requests:
        if request.nbytes > window_bytes:
            total += _serve_large(fs, base, request, lookup, window_bytes, report)
    return total


def _execute_local(base: str, requests: Sequence[Request], lookup, report: _Report) -> int:
    """Each request is read in runs of back-to-back parts with `os.preadv` (one call per run, or
    per CHECK_BLOCK_BYTES of checksummed bytes) straight into the destinations' bytes, when a
    part's slice of its destination is contiguous. Any other part (a column range of a wider
    tensor, only some of what is read used, another dtype or device, a non-contiguous
    destination) is staged a cache-sized block of rows at a time (`_read_staged`). Header checks
    ride in the runs, through the scratch buffer.

    A syscall and a few Python steps per run rather than per part: on the small preset a
    same-layout load is ~150 parts in ~6 runs per rank."""
    total = 0
    scratch = bytearray()
    handles: dict[str, object] = {}
    try:
        for request in requests:
            path = f"{base}/{request.file}"
            if path not in handles:
                try:
                    handles[path] = open(path, "rb", buffering=0)
                except (FileNotFoundError, OSError) as error:
                    raise _short_read(path, request.byte_start, request.byte_end, _describe(request), error) from None
            handle = handles[path]
            run: list[tuple] = []  # (part, [its destination bytes]) or (header check, None: staged)
            staged_bytes = 0
            for part in request.parts:
                direct = None if isinstance(part, HeaderCheck) else _direct_buffer(part, lookup(part))
                if direct is None and isinstance(part, ReadItem):
                    total += _read_run(handle, path, run, staged_bytes, scratch, report)
                    run, staged_bytes = [], 0
                    total += _read_staged(handle, path, part, lookup(part), scratch, report)
                    continue
                if run and part.byte_start != run[-1][0].byte_end:  # parts overlap where targets share rows
                    total += _read_run(handle, path, run, staged_bytes, scratch, report)
                    run, staged_bytes = [], 0
                run.append((part, None if direct is None else [direct]))
                staged_bytes += part.nbytes if direct is None else 0
            total += _read_run(handle, path, run, staged_bytes, scratch, report)
    finally:
        for handle in handles.values():
            handle.close()
    return total


def _read_run(handle, path: str, run: list[tuple], staged_bytes: int, scratch: bytearray, report: _Report) -> int:
    """Read one run of back-to-back parts with scatter reads, taking each part's checksum block by
    block as its bytes arrive (whole chunks are checked here; parts of chunks reported), then
    check the headers and report each part in file order."""
    if not run:
        return 0
    _grow(scratch, staged_bytes)
    free = memoryview(scratch)
    placed = []  # (part, its buffers, its running checksum or None)
    for part, direct in run:
        if direct is None:  # a header check
            direct, free = [free[:part.nbytes]], free[part.nbytes:]
        placed.append((part, direct, report.running_for(part, path)))
    start = run[0][0].byte_start
    got = _read_checking(handle, start, placed)
    if got != run[-1][0].byte_end - start:
        short = next(part for part, _ in run if part.byte_end > start + got)
        raise _short_read(path, short.byte_start, short.byte_end, _describe(Request(short.file, 0, 0, (short,))),
                          max(0, got - (short.byte_start - start)))
    for part, buffers, running in placed:
        if isinstance(part, HeaderCheck):
            _check_header(part, buffers[0], path)
            continue
        if running is not None and part.whole_chunk and running.text() != part.chunk.checksum:
            raise _checksum_mismatch(part, path)
        report.done(part, running)
    return got


def _read_staged(handle, path: str, part: ReadItem, destination: Destination, scratch: bytearray, report: _Report) -> int:
    """A part that cannot land in place, read into the scratch buffer a block of whole rows at a
    time, each block checksummed there and copied into place while it is still in cache.

    Why not scatter rows straight into the destination: the kernel's copy into memory not yet in
    cache does not leave it there, so checksumming the rows afterwards read them back from
    memory: on a 200 MiB tensor's column half read into a row shard, scatter + checksum took
    25.2 ms per 100 MiB, staged blocks + checksum + copy 20.7 (docs/decisions.md 49)."""
    block_bytes = CHECK_BLOCK_BYTES if destination.tensor.device.type == "cpu" else STAGE_BYTES  # device: fewer, larger copies

    def read(start: int, end: int) -> memoryview:
        _grow(scratch, end - start)
        block = memoryview(scratch)[:end - start]
        got = _read_into(handle, start, [block])
        if got != len(block):
            raise _short_read(path, part.byte_start, part.byte_end, _describe(Request(part.file, 0, 0, (part,))),
                              start - part.byte_start + got)
        return block

    return _place_in_row_blocks(part, destination, read, block_bytes, report, path)


def _place_in_row_blocks(part: ReadItem, destination: Destination, read: Callable[[int, int], object], block_bytes: int,
                         report: _Report, path: str) -> int:
    """Read a part a block of whole rows at a time (`read(start, end)` returns those bytes), feed
    each block to its checksum and copy what the target needs of it into place; then check the
    chunk (read whole) or report the part. Shared by staged local reads and by object-store parts
    bigger than the fetch window."""
    rows = part.held_sizes[0] if part.held_sizes else 1
    row_bytes = part.nbytes // rows
    rows_per_block = max(1, block_bytes // max(1, row_bytes))
    running = report.running_for(part, path)
    for first in range(0, rows, rows_per_block):
        count = min(rows_per_block, rows - first)
        start = part.byte_start + first * row_bytes
        block = read(start, start + count * row_bytes)
        if running is not None:
            running.update(block)
        piece = _rows_of(part, first, count, start) if part.held_sizes else part
        if piece is not None:
            _copy_item(piece, block, destination, path)
    if running is not None and part.whole_chunk and running.text() != part.chunk.checksum:
        raise _checksum_mismatch(part, path)
    report.done(part, running)
    return part.nbytes


def _rows_of(part: ReadItem, first: int, count: int, start: int) -> ReadItem | None:
    """The part narrowed to `count` of its held rows from `first` (bytes from `start`), or None
    when the target needs none of them."""
    held_offsets = (part.held_offsets[0] + first, *part.held_offsets[1:])
    held_sizes = (count, *part.held_sizes[1:])
    bounds = [(max(a, b), min(a + sa, b + sb)) for a, sa, b, sb in zip(held_offsets, held_sizes, part.offsets, part.sizes)]
    if not all(low < high for low, high in bounds):
        return None
    return ReadItem(part.chunk, start, start + count * (part.nbytes // part.held_sizes[0]), held_offsets, held_sizes,
                    tuple(low for low, _ in bounds), tuple(high - low for low, high in bounds))


def _grow(scratch: bytearray, size: int) -> None:
    if len(scratch) < size:
        scratch.extend(bytes(size - len(scratch)))  # grows in place: one buffer for the load


# Checksums are taken a block at a time right after the block is read, while its bytes are still
# in cache: reading 400 MiB from the page cache measured 4.53 GB/s alone, 3.60 GB/s when checked
# after the whole read, and 4.46-4.50 GB/s checked every 256 KiB-4 MiB (docs/decisions.md 43).
CHECK_BLOCK_BYTES = 2**20


def _read_checking(handle, start: int, placed: list[tuple]) -> int:
    """Read the parts' buffers from `start` in order; feed each checked part's running checksum
    a block after it lands. Bytes read (fewer only when the file ends early)."""
    position, batch, batch_bytes, to_check = start, [], 0, []

    def flush() -> bool:
        nonlocal position, batch, batch_bytes, to_check
        got = _read_into(handle, position, batch) if batch else 0
        for running, buffer in to_check:
            running.update(buffer)  # a block cut short is caught by the byte count, not the checksum
        complete = got == batch_bytes
        position, batch, batch_bytes, to_check = position + got, [], 0, []
        return complete

    for part, buffers, running in placed:
        if running is None:  # unchecked bytes (header checks) go in whole
            batch += buffers
            batch_bytes += part.nbytes
            continue
        for buffer in buffers:
            for at in range(0, len(buffer), CHECK_BLOCK_BYTES):
                piece = buffer[at:at + CHECK_BLOCK_BYTES]
                batch.append(piece)
                to_check.append((running, piece))
                batch_bytes += len(piece)
                if batch_bytes >= CHECK_BLOCK_BYTES and not flush():
                    return position - start
    flush()
    return position - start


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's bytes as one flat writable buffer (as bytes: numpy has no bfloat16)."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy())


def _direct_buffer(item: ReadItem, destination: Destination) -> memoryview | None:
    """The destination's bytes the item fills, when they are one contiguous run of it (the item
    fills its slice of the destination exactly, and that slice spans whole trailing dims). None
    when the part must be staged (a column range of a wider tensor, only part of what is read
    used, another dtype or device, a non-contiguous destination)."""
    tensor, target_offsets = destination.tensor, destination.offsets
    if (item.sizes != item.held_sizes or tensor.dtype != _TORCH_DTYPES.get(item.chunk.dtype) or tensor.device.type != "cpu"
            or not tensor.is_contiguous() or tensor.numel() == 0):
        return None
    shape, sizes = tuple(tensor.shape), item.sizes
    # Dims from `inner` on are spanned whole; at most the first may be cut for one contiguous run.
    inner = len(sizes)
    while inner > 0 and sizes[inner - 1] == shape[inner - 1]:
        inner -= 1
    if inner > 1:
        return None
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    first = sum((o - t) * stride for o, t, stride in zip(item.offsets, target_offsets, strides)) * tensor.element_size()
    return _tensor_bytes(tensor)[first:first + item.nbytes]


_TORCH_DTYPES = {name: getattr(torch, name) for name in SAFETENSORS_DTYPES}
# os.preadv scatters one read into many buffers (at most IOV_MAX per call); where it is missing
# (not POSIX), reads are staged and copied instead.
_SCATTER_READS = hasattr(os, "preadv")
try:
    _IOV_MAX = max(1, os.sysconf("SC_IOV_MAX"))
except (AttributeError, ValueError, OSError):
    _IOV_MAX = 1024


def _read_into(handle, start: int, segments: list) -> int:
    """Read consecutive file bytes from `start` into the segments in order; bytes read (fewer
    only at the end of the file)."""
    if not _SCATTER_READS:
        got = 0
        for segment in segments:
            handle.seek(start + got)
            read = handle.readinto(segment) or 0
            got += read
            if read < len(segment):
                break
        return got
    # A call may return short of the end of the file (Linux moves at most ~2 GiB a call; FUSE
    # mounts may return less), so go on from where it stopped until a call reads nothing. The
    # segments are 1-D byte buffers (len is bytes); only after a short call are they walked one
    # by one, which costs a Python step per row.
    descriptor, got, pending, first = handle.fileno(), 0, segments, 0
    while first < len(pending):
        batch = pending[first:first + _IOV_MAX]
        read = os.preadv(descriptor, batch, start + got)
        if read == 0:
            break
        got += read
        if read == sum(map(len, batch)):
            first += len(batch)
            continue
        if pending is segments:
            pending, first = [memoryview(s).cast("B") for s in segments[first:]], 0
        while read and first < len(pending):
            if read >= pending[first].nbytes:
                read -= pending[first].nbytes
                first += 1
            else:
                pending[first] = pending[first][read:]
                read = 0
    return got


def _describe(request: Request) -> str:
    names = sorted({f"{p.chunk.name} ({p.chunk.kind})" for p in request.parts if isinstance(p, ReadItem)})
    return ", ".join(names[:3]) + (" ..." if len(names) > 3 else "") if names else "the safetensors header"


def _serve(request: Request, blob, path: str, lookup, report: _Report) -> None:
    view = memoryview(blob)
    for part in request.parts:
        data = view[part.byte_start - request.byte_start: part.byte_end - request.byte_start]
        if isinstance(part, HeaderCheck):
            _check_header(part, data, path)
            continue
        running = report.running_for(part, path)
        if running is not None:
            running.update(data)
            if part.whole_chunk and running.text() != part.chunk.checksum:
                raise _checksum_mismatch(part, path)
        _copy_item(part, data, lookup(part), path)
        report.done(part, running)


def _serve_large(fs, base: str, request: Request, lookup, window_bytes: int, report: _Report) -> int:
    """A request bigger than the window: read each part on its own, and a whole-rows item bigger
    than the window in row blocks, verifying its checksum incrementally."""
    path = f"{base}/{request.file}"
    total = 0
    for part in request.parts:
        if isinstance(part, HeaderCheck) or part.nbytes <= window_bytes or len(part.held_sizes) == 0:
            data = _cat(fs, path, part.byte_start, part.byte_end, _describe(Request(part.file, 0, 0, (part,))))
            _serve(Request(request.file, part.byte_start, part.byte_end, (part,)), data, path, lookup, report)
            total += part.nbytes
            continue
        what = f"{part.chunk.name} ({part.chunk.kind})"
        total += _place_in_row_blocks(part, lookup(part), lambda start, end: _cat(fs, path, start, end, what),
                                      window_bytes, report, path)
    return total


def _cat(fs, path: str, start: int, end: int, what: str) -> bytearray:
    try:
        data = read_range(fs, path, start, end)
    except (FileNotFoundError, OSError) as error:
        raise _short_read(path, start, end, what, error) from None
    if len(data) != end - start:
        raise _short_read(path, start, end, what, data)
    return bytearray(data)


def fill_from_reads(fs, base: str, items: list[ReadItem], target: torch.Tensor, target_offsets: tuple[int, ...],
                    window_bytes: int = WINDOW_BYTES, partial: list | None = None) -> int:
    """Fetch one target's items and copy them into `target` (partial: as in execute_requests)."""
    destination = Destination(target, target_offsets)
    return execute_requests(fs, base, coalesce(items, window_bytes), lambda item: destination, window_bytes,
                            partial=partial)

