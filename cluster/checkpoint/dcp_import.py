"""`rayshard ckpt import DIR --format dcp`: a torch.distributed.checkpoint directory of torchtitan's
Llama (model + AdamW, any layout that wrote it) as a rayshard checkpoint, streamed.

Nothing in the directory is unpickled beyond DCP's metadata records (`dcp_metadata.py`) and the
records that locate each tensor chunk's bytes (`dcp_records.py`). The model configuration comes
from the caller (DCP carries none) and every tensor's shape is checked against it before anything
is written. Weights and moments go through torchtitan's mapping inverted (`plans/interop/
torchtitan.py`), a row band at a time (`row_bands.py`): each band takes just the rows it needs
from the `.distcp` files, so memory stays at a band or two whatever the model's size. On a local
file system a band is taken from a read-only memory map of those rows (a renamed band is the map
itself, written from the page cache; qkv and gate_up are gathered straight from the maps), one
copy per byte instead of a read into a buffer and a gather (decision 131); elsewhere, and for rows
a map cannot give (a band across chunks, a tp shard's column block), they are read into buffers. The AdamW step comes from the optimizer's per-parameter `step` (all equal), else
from `train_state.step`, else 0; moments absent from the checkpoint start at zero, as a fresh
AdamW's do. The rest of the directory (param_groups, lr_scheduler, dataloader, train_state) is
skipped by name and counted in the log.

The writes go under a fresh attempt prefix of the run and the manifest commits them last, under
the run's writer lease: any refusal (one line naming what) leaves nothing committed.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import mmap
import os
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from rayshard.actors.checkpoint.shard_writer import LazyTensor, Piece, write_shard
from rayshard.cluster.catalog import writer_lease
from rayshard.cluster.checkpoint.dcp_metadata import DcpContents, DcpTensor, read_dcp_metadata
from rayshard.cluster.checkpoint.dcp_records import MAX_VALUE_BYTES, ChunkBytes, locate_chunk, read_plain_value
from rayshard.cluster.checkpoint.read_ahead import reading_ahead
from rayshard.cluster.checkpoint.row_bands import BAND_BYTES, Buffers, bands, fill_band, one_torch_thread, row_origins
from rayshard.cluster.progress import counted, set_total
from rayshard.plans.checkpoint.chunks import EXP_AVG, EXP_AVG_SQ, PARAM, Chunk
from rayshard.plans.checkpoint.reshard import check_chunks_disjoint_and_complete
from rayshard.plans.checkpoint.safetensors_layout import ITEMSIZE
from rayshard.plans.errors import CheckpointError
from rayshard.plans.interop.torchtitan import STEP, classify_key, is_auxiliary, torchtitan_mapping
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import ModelConfig, parameter_shapes
from rayshard.plans.transforms.mapping import Meta

IMPORT_FILE_BYTES = 2 * 2**30
MOMENTS = (EXP_AVG, EXP_AVG_SQ)
FLOATING = ("float32", "bfloat16", "float16", "float64")
STEP_DTYPES = ("int32", "int64", "int16", "float32", "float64")
TRAIN_STEP_KEYS = ("train_state.step", "model.train_state.step")
OPEN_FILES = 64  # .distcp handles kept open at once (a checkpoint of 16k ranks has 16k files)
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault a band's pages in with the map, not one by one
# Bands from memory maps of the .distcp pages (one copy per byte) rather than reads into buffers
# (two or three): decision 131. RAYSHARD_DCP_IMPORT_VIEWS=0 reads as before (the bench compares both).
VIEWS_DEFAULT = os.environ.get("RAYSHARD_DCP_IMPORT_VIEWS", "1") != "0"
# The next band produced on a background thread while one is written: off unless
# RAYSHARD_DCP_IMPORT_READ_AHEAD=1, since on the 2-core machine it bought no wall time and cost
# CPU (decision 195); for a machine with a core to spare.
READ_AHEAD_DEFAULT = os.environ.get("RAYSHARD_DCP_IMPORT_READ_AHEAD", "0") == "1"


class DcpReader:
    """Row ranges of DCP tensors read straight into caller buffers, from located chunk bytes; on a
    local file system also handed out as views of the files' own pages (`row_view`)."""

    def __init__(self, fs, base: str, directory: str, located: dict[tuple[str, tuple], ChunkBytes]):
        self.fs, self.base, self.directory, self.located = fs, base, directory, located
        self.handles: OrderedDict[str, object] = OrderedDict()
        self.bytes_read = 0
        self.mappable = isinstance(fs, LocalFileSystem) and hasattr(mmap, "MAP_PRIVATE")

    def row_view(self, tensor: DcpTensor, first: int, end: int) -> torch.Tensor | None:
        """Rows [first, end) of `tensor` as uint8 rows over a read-only memory map of its `.distcp`
        bytes (the page cache, no copy), when they lie in one chunk of whole rows on a local file
        system; else None. The map lives as long as the tensor (unmapped when it is freed), so a
        band's pages are mapped only while it is written. The byte range was checked against the
        file's size when the chunk was located."""
        if not self.mappable or not tensor.shape or end <= first:
            return None
        itemsize = ITEMSIZE[tensor.dtype]
        row_bytes = itemsize
        for extent in tensor.shape[1:]:
            row_bytes *= extent
        for chunk in tensor.chunks:
            if chunk.offsets[0] <= first and end <= chunk.offsets[0] + chunk.sizes[0]:
                if tuple(chunk.sizes[1:]) != tuple(tensor.shape[1:]):
                    return None  # a block of columns: its rows are not whole rows of the tensor
                located = self.located[(tensor.key, chunk.offsets)]
                start = located.start + (first - chunk.offsets[0]) * row_bytes
                length = (end - first) * row_bytes
                base = start - start % mmap.ALLOCATIONGRANULARITY
                descriptor = os.open(f"{self.base}/{located.file}", os.O_RDONLY)
                try:  # read-only: a writable private map would be populated by copy-on-write faults, a copy per page
                    pages = mmap.mmap(descriptor, start + length - base, flags=mmap.MAP_SHARED | MAP_POPULATE,
                                      prot=mmap.PROT_READ, offset=base)
                finally:
                    os.close(descriptor)
                self.bytes_read += length
                with warnings.catch_warnings():  # torch warns that the buffer is read-only; only reads touch it
                    warnings.simplefilter("ignore", UserWarning)
                    # Bytes, not the dtype: an item sits at any offset of its .distcp file, so its data need
                    # not be aligned to the element size; rows of bytes are copied alike.
                    rows = torch.frombuffer(pages, dtype=torch.uint8, count=length, offset=start - base)
                return rows.reshape(end - first, row_bytes)
        return None

    def handle(self, file: str):
        if file in self.handles:
            self.handles.move_to_end(file)
            return self.handles[file]
        if len(self.handles) >= OPEN_FILES:
            self.handles.popitem(last=False)[1].close()
        self.handles[file] = self.fs.open(f"{self.base}/{file}", "rb")
        return self.handles[file]

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()
        self.handles.clear()

    def read_into(self, file: str, start: int, into: torch.Tensor) -> None:
        view = memoryview(into.reshape(-1).view(torch.uint8).numpy()).cast("B")
        handle = self.handle(file)
        handle.seek(start)
        filled = 0
        while filled < len(view):
            count = handle.readinto(view[filled:])
            if not count:
                raise CheckpointError(f"{self.directory}/{file}: ends before byte {start + len(view)}; the file is "
                                      "truncated. Fix: import a checkpoint whose save finished")
            filled += count
        self.bytes_read += filled

    def read_rows(self, tensor: DcpTensor, first: int, end: int, into: torch.Tensor) -> None:
        """Rows [first, end) of `tensor` (its whole value if 0-d) into `into`."""
        itemsize = ITEMSIZE[tensor.dtype]
        if not tensor.shape:
            located = self.located[(tensor.key, ())]
            self.read_into(located.file, located.start, into)
            return
        for chunk in tensor.chunks:
            low, high = max(first, chunk.offsets[0]), min(end, chunk.offsets[0] + chunk.sizes[0])
            if low >= high:
                continue
            located = self.located[(tensor.key, chunk.offsets)]
            row_bytes = itemsize
            for extent in chunk.sizes[1:]:
                row_bytes *= extent
            start = located.start + (low - chunk.offsets[0]) * row_bytes
            target = into[low - first:high - first]
            if tuple(chunk.sizes[1:]) == tuple(tensor.shape[1:]):  # whole rows: straight into place
                self.read_into(located.file, start, target)
            else:  # a block of columns too (tp's rowwise shards): its rows, then into their columns
                block = torch.empty((high - low, *chunk.sizes[1:]), dtype=into.dtype)
                self.read_into(located.file, start, block)
                target[(slice(None), *(slice(o, o + s) for o, s in zip(chunk.offsets[1:], chunk.sizes[1:])))] = block


@dataclass
class _Found:
    """The DCP tensors that are the model's: (torchtitan name, kind) -> tensor; step tensors by name."""

    states: dict[tuple[str, str], DcpTensor]
    steps: dict[str, DcpTensor]
    skipped: list[str]
    train_step: DcpTensor | None = None  # torchtitan's train_state.step when saved as a tensor (a 0-d int32)


def _classify(contents: DcpContents, shapes: dict[str, tuple[int, ...]], directory: str, source: str) -> _Found:
    found = _Found({}, {}, [])
    names = set(shapes)
    prefixes: dict[tuple[str, str], str] = {}
    for key, tensor in contents.tensors.items():
        match = classify_key(key, names)
        if match is None:
            if key in TRAIN_STEP_KEYS:
                found.train_step = tensor
            if is_auxiliary(key):
                found.skipped.append(key)
                continue
            example = next(iter(sorted(names)))
            raise CheckpointError(f"{directory}: tensor {key} {list(tensor.shape)} has no place in torchtitan's Llama of "
                                  f"{source} (whose tensors are named like {example}, under model. or optimizer.state. "
                                  "for AdamW's exp_avg/exp_avg_sq/step). Fix: pass the model configuration the "
                                  "checkpoint was trained with; rayshard imports torchtitan's Llama with AdamW")
        name, kind, prefix = match
        if kind == STEP:
            found.steps[name] = tensor
            continue
        if (name, kind) in found.states:
            raise CheckpointError(f"{directory}: holds {name} ({kind}) twice, as {state_name(prefixes[(name, kind)], name, kind)} "
                                  f"and {key}; rayshard cannot tell which to import. Fix: import a checkpoint of one model")
        found.states[(name, kind)] = tensor
        prefixes[(name, kind)] = prefix
    found.skipped += sorted(contents.values)
    return found


def state_name(prefix: str, name: str, kind: str) -> str:
    return f"{prefix}{name}" if kind == PARAM else f"{prefix}state.{name}.{kind}"


def _check_shapes(found: _Found, shapes: dict[str, tuple[int, ...]], directory: str, source: str) -> list[str]:
    """Every weight present and shaped as the model says; moments all present or all absent.
    Returns the kinds to import from the checkpoint."""
    missing = sorted(name for name in shapes if (name, PARAM) not in found.states)
    if missing:
        raise CheckpointError(f"{directory}: lacks {len(missing)} of the model's {len(shapes)} weights, e.g. {missing[0]} "
                              f"(torchtitan name); it is not a checkpoint of {source}. Fix: pass the model configuration "
                              "the checkpoint was trained with")
    for (name, kind), tensor in sorted(found.states.items()):
        if tensor.shape != tuple(shapes[name]):
            raise CheckpointError(f"{directory}: {tensor.key} has shape {list(tensor.shape)} but {source} needs "
                                  f"{list(shapes[name])} for it. Fix: pass the model configuration the checkpoint was "
                                  "trained with (--hf-config, --model or --config)")
        if tensor.dtype not in FLOATING:
            raise CheckpointError(f"{directory}: {tensor.key} is {tensor.dtype}; rayshard imports floating-point weights "
                                  f"and moments ({', '.join(FLOATING)})")
    kinds = [PARAM]
    for kind in MOMENTS:
        present = [name for name in shapes if (name, kind) in found.states]
        if present and len(present) != len(shapes):
            absent = sorted(set(shapes) - set(present))
            raise CheckpointError(f"{directory}: holds AdamW {kind} for {len(present)} of the model's {len(shapes)} "
                                  f"parameters but not for {absent[0]}; a partial optimizer state cannot resume. Fix: "
                                  "import a checkpoint saved with the whole optimizer state, or without it")
        if present:
            kinds.append(kind)
    if len(kinds) == 2:
        raise CheckpointError(f"{directory}: holds AdamW {kinds[1]} but not its other moment. Fix: import a checkpoint "
                              "saved with the whole optimizer state, or without it")
    return kinds


def _check_tiling(found: _Found, directory: str) -> None:
    """Each tensor's chunks cover it exactly once (the band reader fills buffers from them)."""
    chunks = [Chunk(tensor.key, kind, tensor.dtype, tensor.shape, chunk.offsets, chunk.sizes, chunk.file, 0, 0, "")
              for (_, kind), tensor in found.states.items() for chunk in tensor.chunks]
    try:
        check_chunks_disjoint_and_complete(chunks)
    except CheckpointError as error:
        raise CheckpointError(f"{directory}: its .metadata does not tile every tensor: {str(error).splitlines()[0]}") from None


def _locate(fs, base: str, directory: str, tensors: list[DcpTensor]) -> dict[tuple[str, tuple], ChunkBytes]:
    """Every chunk's data bytes in its file, checked before anything is written."""
    by_file: dict[str, list] = {}
    for tensor in tensors:
        for chunk in tensor.chunks:
            by_file.setdefault(chunk.file, []).append((tensor, chunk))
    located = {}
    for file, members in sorted(by_file.items()):
        path = f"{base}/{file}"
        if not fs.exists(path):
            raise CheckpointError(f"{directory}/{file}: missing, though .metadata lists {len(members)} item(s) in it. "
                                  "Fix: copy the whole checkpoint directory")
        size = fs.size(path)
        with fs.open(path, "rb") as handle:
            for tensor, chunk in members:
                if chunk.start + chunk.length > size:
                    raise CheckpointError(f"{directory}/{file}: has {size} bytes but .metadata places {tensor.key} at "
                                          f"bytes {chunk.start}+{chunk.length}; the file is truncated. Fix: import a "
                                          "checkpoint whose save finished")
                where = f"{directory}/{file} ({tensor.key} at {list(chunk.offsets)})"
                located[(tensor.key, chunk.offsets)] = locate_chunk(handle, chunk, tensor.dtype, where)
    return located


def _step_of(found: _Found, contents: DcpContents, reader: DcpReader, fs, base: str, directory: str, log) -> int:
    """AdamW's step count: the same in every parameter's state; else train_state.step (a number,
    or the 0-d tensor torchtitan's TrainState saves); else 0. AdamW's count decides the bias
    correction a resume continues with, so it wins where both are present (a difference is noted)."""
    train_step = _train_step(found, contents, reader, fs, base, directory)
    values = {}
    for name, tensor in found.steps.items():
        if tensor.shape != ():
            raise CheckpointError(f"{directory}: {tensor.key} has shape {list(tensor.shape)}; AdamW's step is a number")
        value = torch.empty((), dtype=getattr(torch, tensor.dtype))
        reader.read_rows(tensor, 0, 1, value)
        values[name] = value.item()
    if values:
        distinct = sorted(set(values.values()))
        if len(distinct) != 1 or not _whole_number(distinct[0]):
            raise CheckpointError(f"{directory}: AdamW's step differs between parameters or is not a whole number "
                                  f"({distinct[:4]}); rayshard keeps one step per checkpoint. Fix: import a checkpoint "
                                  "whose parameters were all stepped together")
        if train_step is not None and train_step != int(distinct[0]):
            log(f"note: {directory} holds train_state.step {train_step} but AdamW's step {int(distinct[0])}; the import "
                "is AdamW's step (its bias correction continues from it)")
        return int(distinct[0])
    if train_step is not None:
        return train_step
    log(f"note: {directory} holds no AdamW step and no train_state.step; the import is step 0")
    return 0


def _whole_number(number: float) -> bool:
    """A step count: finite (int() of NaN or infinity raises), whole and not negative."""
    return math.isfinite(number) and number == int(number) and number >= 0


def _train_step(found: _Found, contents: DcpContents, reader: DcpReader, fs, base: str, directory: str) -> int | None:
    """torchtitan's train_state.step: a 0-d integer tensor (its TrainState saves
    `torch.tensor(step, dtype=torch.int32)`) or a plain number; None when absent."""
    tensor = found.train_step
    if tensor is not None:
        if tensor.shape != () or tensor.dtype not in STEP_DTYPES:
            raise CheckpointError(f"{directory}: {tensor.key} is {tensor.dtype}{list(tensor.shape)}; a training step is a "
                                  "number (a 0-d integer or float tensor). Fix: import a checkpoint whose train_state "
                                  "is torchtitan's")
        value = torch.empty((), dtype=getattr(torch, tensor.dtype))
        reader.read_rows(tensor, 0, 1, value)
        number = value.item()
        if not _whole_number(number):
            raise CheckpointError(f"{directory}: {tensor.key} is {number}, not a whole number of steps >= 0. Fix: import "
                                  "a checkpoint whose train_state is torchtitan's")
        return int(number)
    for prefix in TRAIN_STEP_KEYS:
        if prefix in contents.values:
            item = contents.values[prefix]
            if item.length > MAX_VALUE_BYTES:  # .metadata says how long; a step is a few bytes
                continue
            with fs.open(f"{base}/{item.file}", "rb") as handle:
                handle.seek(item.start)
                value = read_plain_value(handle.read(item.length))
            if isinstance(value.value, int) and not isinstance(value.value, bool) and value.value >= 0:
                return value.value
    return None


@dataclass
class _Prepared:
    """A DCP directory read and checked against the model: everything but the writing."""

    contents: DcpContents
    found: _Found
    kinds: list[str]
    reader: DcpReader
    step: int


def import_dcp(directory: str, store, run: str, model: ModelConfig, source: str, dtype: str = "float32",
               model_preset: str | None = None, file_bytes: int = IMPORT_FILE_BYTES, band_bytes: int = BAND_BYTES,
               log=print, progress=None, views: bool | None = None, read_ahead: bool | None = None) -> str:
    """Write a rayshard checkpoint (run@step) from a DCP directory of torchtitan's Llama; commit it.
    model: its configuration (`source` says where it came from, for messages). The directory is
    read and checked whole first, so a refusal leaves the store untouched; the writing holds the
    run's writer lease, as every writer of a run does. views: bands from memory maps of a local
    directory's pages (decision 131; default on, RAYSHARD_DCP_IMPORT_VIEWS=0 turns it off). read_ahead:
    the next band produced on a background thread while one is written (decision 195; default off,
    RAYSHARD_DCP_IMPORT_READ_AHEAD=1 turns it on)."""
    started = time.perf_counter()
    mapping = torchtitan_mapping(model)
    ours = parameter_shapes(model)
    prepared = _prepare(directory, model, source, mapping, ours, dtype, log)
    try:
        with writer_lease.holding(store, run), one_torch_thread():
            committed = _write(prepared, directory, store, run, model, mapping, ours, dtype, model_preset, file_bytes,
                               band_bytes, progress, VIEWS_DEFAULT if views is None else views,
                               READ_AHEAD_DEFAULT if read_ahead is None else read_ahead)
    finally:
        prepared.reader.close()
    found, kinds = prepared.found, prepared.kinds
    skipped = (f"; skipped {len(found.skipped)} entries that are not weights or AdamW moments "
               f"({', '.join(sorted({k.split('.')[0] for k in found.skipped})[:6])})" if found.skipped else "")
    log(f"imported {directory} as {run}@{prepared.step}: {committed} ({prepared.reader.bytes_read / 2**20:.1f} MiB read in "
        f"{time.perf_counter() - started:.1f}s; AdamW moments {'imported' if len(kinds) > 1 else 'absent: zeros'}{skipped})")
    return committed


def _prepare(directory, model, source, mapping, ours, dtype, log) -> _Prepared:
    fs, base = fsspec.core.url_to_fs(directory)
    base = base.rstrip("/")
    contents = read_dcp_metadata(fs, base, directory)
    export_plan = mapping.plan({name: Meta(tuple(shape), dtype) for name, shape in ours.items()})
    shapes = {name: meta.shape for name, meta in export_plan.outputs.items()}  # torchtitan's names and shapes
    found = _classify(contents, shapes, directory, source)
    kinds = _check_shapes(found, shapes, directory, source)
    _check_tiling(found, directory)
    located = _locate(fs, base, directory, list(found.states.values()) + list(found.steps.values())
                      + ([found.train_step] if found.train_step is not None else []))
    reader = DcpReader(fs, base, directory, located)
    try:
        step = _step_of(found, contents, reader, fs, base, directory, log)
    except BaseException:
        reader.close()
        raise
    return _Prepared(contents, found, kinds, reader, step)


def _write(prepared: _Prepared, directory, store, run, model, mapping, ours, dtype, model_preset, file_bytes, band_bytes,
           progress, views: bool, read_ahead: bool) -> str:
    if read_ahead:  # two bands alive instead of one: half as large, so the memory bound stays (decision 195)
        band_bytes = max(1, band_bytes // 2)
    bands_to_write = _bands(prepared.found, prepared.kinds, mapping, ours, dtype, prepared.reader, band_bytes, views,
                            slots=2 if read_ahead else 1)
    set_total(progress, sum(_piece_bytes(band.piece) for band in bands_to_write))
    store.refuse_committed(run, prepared.step, "import into another --run, or remove that run first")
    pending = store.begin(run, prepared.step)
    target_fs, target_base = fsspec.core.url_to_fs(pending.url)
    chunks = []
    with (reading_ahead([band.load for band in bands_to_write]) if read_ahead
          else contextlib.nullcontext([lambda band=band: band.load(0) for band in bands_to_write])) as loads:
        pieces = [dataclasses.replace(band.piece, tensor=LazyTensor(band.piece.tensor.dtype, band.piece.tensor.shape,
                                                                    counted(load, progress)))
                  for band, load in zip(bands_to_write, loads)]
        for number, members in enumerate(_files(pieces, file_bytes)):
            chunks += write_shard(target_fs, target_base, pending.file_for(number, stem="import"), members)
    metadata = {"run": run, "step": prepared.step, "model": model.to_dict(), "model_preset": model_preset,
                "layout": ParallelLayout().to_dict(), "parent": None, "imported_from": directory,
                "imported_format": {"format": "torch.distributed.checkpoint", "dcp_version": prepared.contents.version,
                                    "names": "torchtitan llama", "read_by_torch": torch.__version__,
                                    "optimizer_state": ("imported" if len(prepared.kinds) > 1
                                                        else "zeros (none in the checkpoint)")},
                "created_unix": time.time()}
    return pending.commit(chunks, metadata)


def _piece_bytes(piece: Piece) -> int:
    count = ITEMSIZE[str(piece.tensor.dtype).removeprefix("torch.")]
    for extent in piece.tensor.shape:
        count *= extent
    return count


@dataclass(frozen=True)
class _Band:
    """One row band to write: its piece (whose tensor is a LazyTensor of its dtype and shape) and
    how to produce it into buffer set `slot` (two sets when bands are read ahead, decision 195)."""

    piece: Piece
    load: Callable[[int], torch.Tensor]


def _bands(found: _Found, kinds: list[str], mapping, ours: dict, dtype: str, reader: DcpReader, band_bytes: int,
           views: bool = True, slots: int = 1) -> list[_Band]:
    """One lazily filled band of every rayshard tensor and kind, in mapping order."""
    target = getattr(torch, dtype)
    itemsize = ITEMSIZE[dtype]
    result = []
    inverse = mapping.inverse()
    # The writer finishes a band before it asks for the next, and a read-ahead produces at most one
    # band beyond it, so bands reuse `slots` buffer sets, a band's set being its parity.
    buffer_sets = [Buffers() for _ in range(slots)]

    def lazy(band: tuple[int, ...]) -> LazyTensor:
        return LazyTensor(target, band, _unloaded)
    for kind in (PARAM, *MOMENTS):
        if kind not in kinds:  # no moments in the checkpoint: a fresh AdamW's zeros
            for name, shape in ours.items():
                for first, end in bands(tuple(shape), itemsize, band_bytes):
                    band = (end - first, *shape[1:])
                    result.append(_Band(Piece(name, kind, lazy(band), tuple(shape), (first,) + (0,) * (len(shape) - 1)),
                                        lambda slot, band=band: buffer_sets[slot].take("band", band, target).zero_()))
            continue
        sources = {name: tensor for (name, k), tensor in found.states.items() if k == kind}
        metas = {name: Meta(tensor.shape, tensor.dtype) for name, tensor in sources.items()}
        plan = inverse.plan(metas)
        for group in plan.groups:
            origins = row_origins(group, metas)
            source_shapes = {name: metas[name].shape for name in group.sources}
            source_dtypes = {name: getattr(torch, metas[name].dtype) for name in group.sources}

            def read_rows(name, first, end, into, sources=sources):
                reader.read_rows(sources[name], first, end, into)

            def row_view(name, first, end, sources=sources):
                return reader.row_view(sources[name], first, end) if views else None
            for name in group.outputs:
                shape = tuple(ours[name])
                for first, end in bands(shape, itemsize, band_bytes):
                    band = (end - first, *shape[1:]) if shape else ()

                    def load(slot, origin=origins[name], first=first, end=end, band=band, source_shapes=source_shapes,
                             source_dtypes=source_dtypes, read_rows=read_rows, row_view=row_view):
                        buffers = buffer_sets[slot]
                        return fill_band(origin, first, end, buffers.take("band", band, target), source_shapes,
                                         source_dtypes, read_rows, buffers.take, row_view)
                    result.append(_Band(Piece(name, kind, lazy(band), shape,
                                              (first,) + (0,) * (len(shape) - 1) if shape else ()), load))
    return result


def _unloaded() -> torch.Tensor:
    raise AssertionError("a band's piece is written through its _Band.load, never its placeholder")


def _files(pieces: list[Piece], limit: int):
    group, size = [], 0
    for piece in pieces:
        if group and size + _piece_bytes(piece) > limit:
            yield group
            group, size = [], 0
        group.append(piece)
        size += _piece_bytes(piece)
    if group:
        yield group
