"""`rayshard ckpt export RUN[@STEP] --format dcp --out DIR`: a checkpoint as a
torch.distributed.checkpoint directory of torchtitan's Llama, which `dcp.load` reads on any world
size (its planner intersects whatever chunks a reader asks for with the ones stored).

The layout is torchtitan's CheckpointManager's: model weights at the top level under torchtitan's
names (`tok_embeddings.weight`, `layers.0.attention.wq.weight`, ...), the optimizer flattened under
`optimizer.` as `get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)` gives it:
`optimizer.state.<fqn>.exp_avg|exp_avg_sq|step` tensors and `optimizer.param_groups.<fqn>.<setting>`
values (AdamW's settings from the run's config, the rest AdamW's defaults in this torch). No
train_state, lr_scheduler or dataloader state: rayshard's are functions of the step.

Every tensor is cut in row bands (`row_bands.py`): each band is one DCP chunk, read from the
rayshard checkpoint (only the rows it needs), mapped and written as one torch.save item, so no
process holds more than a band per worker, and `--workers N` writers fill N files
(`__<w>_0.distcp`) in parallel. The records are torch's own (Metadata, TensorStorageMetadata,
ChunkStorageMetadata, MetadataIndex, _StorageInfo) and each item is written the way torch 2.13's
FileSystemWriter writes it (`torch.save` into the rank's file).

Crash-safe: on a local file system the directory is written as DIR.partial-<id> and renamed to DIR
once `.metadata` is in it; on an object store the `.metadata` (what makes it a checkpoint for
`dcp.load`) is written last.
"""
from __future__ import annotations

import pickle
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import fsspec
import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from rayshard.actors.checkpoint.read_executor import Destination
from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.cluster.checkpoint.described_source import is_api_checkpoint, open_source, reopened
from rayshard.cluster.checkpoint.dcp_metadata import METADATA_FILE
from rayshard.cluster.checkpoint.export_directory import published_when_done, refuse_non_empty
from rayshard.cluster.checkpoint.row_bands import BAND_BYTES, RowOrigins, bands, fill_band, one_torch_thread, row_origins
from rayshard.cluster.progress import advance, set_total
from rayshard.plans.checkpoint.chunks import EXP_AVG, EXP_AVG_SQ, PARAM
from rayshard.plans.checkpoint.model_check import check_against_own_model
from rayshard.plans.interop.model_description import ModelDescription
from rayshard.plans.checkpoint.state_dict_keys import OTHER_KIND, column_of, key_of
from rayshard.storage.manifest_io import read_manifest
from rayshard.plans.checkpoint.reshard import Target
from rayshard.plans.checkpoint.safetensors_layout import ITEMSIZE
from rayshard.plans.errors import CheckpointError
from rayshard.plans.interop.torchtitan import param_group_key, state_key, step_key, torchtitan_mapping
from rayshard.plans.training.lr_schedule import learning_rate
from rayshard.plans.transforms.mapping import Meta

MOMENTS = (EXP_AVG, EXP_AVG_SQ)
OPTIMIZER = "optimizer"
TRAIN_STEP = "train_state.step"


@dataclass(frozen=True)
class _Band:
    """One chunk to write: rows [first, end) of output `name`'s state `kind`."""

    key: str
    name: str
    kind: str
    shape: tuple[int, ...]
    dtype: str
    first: int
    end: int
    origins: RowOrigins | None  # None: a value given whole (`value`)
    sources: dict  # source name -> Meta
    value: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        count = ITEMSIZE[self.dtype]
        for extent in ((self.end - self.first, *self.shape[1:]) if self.shape else ()):
            count *= extent
        return count


@dataclass(frozen=True)
class _Written:
    band: _Band
    file: str
    start: int
    length: int


@dataclass
class DcpExportResult:
    directory: str
    files: list[str]
    tensors: int
    chunks: int
    bytes_written: int
    seconds: float


def export_dcp(checkpoint_url: str, directory: str, workers: int = 1, band_bytes: int = BAND_BYTES, log=print,
               progress=None, description: ModelDescription | None = None) -> DcpExportResult:
    """A rayshard checkpoint as a DCP directory: torchtitan's Llama layout for a checkpoint that
    records its model (or a `rayshard.checkpoint` one given a `description`); a
    `rayshard.checkpoint` checkpoint otherwise under its own state-dict keys, needing no model
    (`_as_saved`, decision 130)."""
    started = time.perf_counter()
    if not directory.strip():
        raise CheckpointError("export --out is empty. Fix: name a new directory, e.g. --out ./dcp-export")
    fs, out = fsspec.core.url_to_fs(directory)
    out = out.rstrip("/")
    refuse_non_empty(fs, out, directory)
    chunks, manifest_metadata = read_manifest(checkpoint_url)
    if manifest_metadata.get("lora"):  # adapters only: torchtitan's Llama has no place for them
        raise CheckpointError(f"{checkpoint_url}: is a LoRA run's checkpoint, which holds its adapters, not a model. Fix: "
                              "export the adapters with --format peft, or the model with them merged with --format hf --merge")
    as_saved = description is None and is_api_checkpoint(manifest_metadata)
    if as_saved:
        stored = StoredCheckpoint(checkpoint_url, chunks, manifest_metadata, keys_checked=True)
        items, values = _as_saved(stored, band_bytes)
        path_of, names_said = _saved_path, "the state dict's own keys"
    else:
        stored = open_source(checkpoint_url, description, chunks, manifest_metadata)
        items, values = _torchtitan_layout(stored, band_bytes)
        path_of, names_said = _path, "torchtitan Llama names"
    set_total(progress, sum(item.nbytes for item in items))
    assigned = _assign(items, max(1, workers))
    files = [f"__{w}_0.distcp" for w in range(len(assigned))]
    with published_when_done(fs, out, directory) as staging:
        with one_torch_thread(), ThreadPoolExecutor(max_workers=len(assigned), thread_name_prefix="dcp-export") as pool:
            futures = [pool.submit(_write_file, fs, f"{staging}/{file}", file, members, values if w == 0 else {},
                                   stored if w == 0 else reopened(stored), progress)
                       for w, (file, members) in enumerate(zip(files, assigned))]
            written = [entry for future in futures for entry in future.result()]
        metadata = _metadata(written, directory, path_of)
        with fs.open(f"{staging}/{METADATA_FILE}", "wb") as handle:  # last: what makes it a checkpoint
            pickle.dump(metadata, handle)
    result = DcpExportResult(directory, files + [METADATA_FILE], len(metadata.state_dict_metadata),
                             sum(1 for entry in written if entry.band.kind != "value"),
                             sum(entry.length for entry in written), time.perf_counter() - started)
    log(f"exported {checkpoint_url} to {directory} as torch.distributed.checkpoint ({names_said}, DCP "
        f"{metadata.version}, torch {torch.__version__}): {result.tensors} entries in {len(files)} file(s), "
        f"{result.bytes_written / 2**20:.1f} MiB in {result.seconds:.1f}s")
    return result


def _torchtitan_layout(stored, band_bytes: int) -> tuple[list[_Band], dict]:
    """Bands of torchtitan's names (model at the top, the optimizer under `optimizer.`), AdamW's
    per-parameter steps and settings, and torchtitan's `train_state.step`."""
    model = check_against_own_model(stored.chunks, stored.metadata, stored.url)
    mapping = torchtitan_mapping(model)
    step = int(stored.metadata.get("step", 0))
    stored_kinds = {kind for _, kind in stored.index}
    kinds = [PARAM] + ([k for k in MOMENTS if k in stored_kinds] if all(k in stored_kinds for k in MOMENTS) else [])
    items: list[_Band] = []
    names: list[str] = []
    for kind in kinds:
        metas = {name: Meta(chunks[0].global_shape, chunks[0].dtype) for (name, k), chunks in stored.tensors().items() if k == kind}
        plan = mapping.plan(metas)
        if kind == PARAM:
            names = list(plan.outputs)
        for group in plan.groups:
            origins = row_origins(group, metas)
            sources = {name: metas[name] for name in group.sources}
            for name in group.outputs:
                meta = plan.outputs[name]
                for first, end in bands(meta.shape, ITEMSIZE[meta.dtype], band_bytes):
                    items.append(_Band(state_key(name, kind), name, kind, meta.shape, meta.dtype, first, end, origins[name],
                                       sources))
    values: dict[str, object] = {}
    if len(kinds) > 1:  # AdamW's step as the optimizer holds it (a float32 scalar), and its settings
        for name in names:
            items.append(_Band(step_key(name), name, "step", (), "float32", 0, 1, None, {},
                               torch.tensor(float(step), dtype=torch.float32)))
        settings = adamw_settings(stored.metadata, step)
        values = {param_group_key(name, setting): value for name in names for setting, value in settings.items()}
    # torchtitan's TrainState saves its step as a 0-d int32 tensor and reads it back with .item().
    items.append(_Band(TRAIN_STEP, "", "train_state", (), "int32", 0, 1, None, {}, torch.tensor(step, dtype=torch.int32)))
    return items, values


def _as_saved(stored: StoredCheckpoint, band_bytes: int) -> tuple[list[_Band], dict]:
    """A `rayshard.checkpoint` checkpoint as the state dict it was saved from: every tensor under
    its flattened key (decision 106's inverse: `model.<fqn>`, `optim.state.<fqn>.<state>`, ...),
    cut in row bands read straight from the stored chunks, and every JSON value (param_groups, a
    loader's position) as the plain object DCP saves a non-tensor leaf as. No model is needed."""
    items = []
    for (name, kind), chunks in sorted(stored.tensors().items()):
        shape, dtype = tuple(chunks[0].global_shape), chunks[0].dtype
        for first, end in bands(shape, ITEMSIZE[dtype], band_bytes):
            items.append(_Band(key_of(name, kind), name, kind, shape, dtype, first, end, None, {}))
    values = stored.metadata.get("state") or {}
    return items, dict(values) if isinstance(values, dict) else {}


def adamw_settings(metadata: dict, step: int) -> dict:
    """AdamW's param_group settings, as this torch's AdamW holds them, with the run's values:
    lr where its schedule stands at `step`, betas, eps, weight_decay; initial_lr (what a LambdaLR
    scheduler, as torchtitan's, adds) the peak lr."""
    schedule = metadata.get("lr_schedule") or (metadata.get("config") or {}).get("optimizer") or {}
    peak = float(schedule.get("lr", 1e-3))
    lr = peak
    if {"min_lr", "warmup_steps"} <= set(schedule):
        lr = learning_rate(step, peak, float(schedule["min_lr"]), int(schedule["warmup_steps"]),
                           int(schedule.get("decay_steps") or max(step, 1)))
    probe = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr,
                              betas=(float(schedule.get("beta1", 0.9)), float(schedule.get("beta2", 0.95))),
                              eps=float(schedule.get("eps", 1e-8)), weight_decay=float(schedule.get("weight_decay", 0.1)))
    settings = {key: value for key, value in probe.param_groups[0].items() if key != "params"}
    settings["initial_lr"] = peak
    return settings


def _assign(items: list[_Band], workers: int) -> list[list[_Band]]:
    """Largest first onto the least loaded writer (as DCP's own writer splits a rank's items)."""
    loads = [0] * min(workers, max(1, len(items)))
    assigned: list[list[_Band]] = [[] for _ in loads]
    for item in sorted(items, key=lambda item: -item.nbytes):
        least = loads.index(min(loads))
        assigned[least].append(item)
        loads[least] += item.nbytes
    for members in assigned:  # in each file, the bands in tensor order (sequential reads)
        members.sort(key=lambda item: (item.kind, item.name, item.first))
    return assigned


def _write_file(fs, path: str, file: str, members: list[_Band], values: dict, stored, progress) -> list[_Written]:
    """One writer: its bands (then, for writer 0, the settings) as torch.save items of one file.
    `stored`: this writer's own reader (partial reads are per reader)."""

    def read_rows(name: str, first: int, end: int, into: torch.Tensor, kind: str) -> None:
        offsets = (first,) + (0,) * (into.dim() - 1) if into.dim() else ()
        stored.read({Target(name, kind, offsets, tuple(into.shape)): Destination(into, offsets)})
    written = []
    with fs.open(path, "wb") as handle:
        for band in members:
            if band.value is not None:
                tensor = band.value
            elif band.origins is None:  # a stored tensor under its own name: its rows as they are
                tensor = torch.empty((band.end - band.first, *band.shape[1:]) if band.shape else (),
                                     dtype=getattr(torch, band.dtype))
                read_rows(band.name, band.first, band.end, tensor, band.kind)
            else:
                shape = (band.end - band.first, *band.shape[1:]) if band.shape else ()
                tensor = fill_band(band.origins, band.first, band.end, torch.empty(shape, dtype=getattr(torch, band.dtype)),
                                   {n: m.shape for n, m in band.sources.items()},
                                   {n: getattr(torch, m.dtype) for n, m in band.sources.items()},
                                   lambda n, a, b, into, kind=band.kind: read_rows(n, a, b, into, kind))
            start = handle.tell()
            torch.save(tensor, handle)
            written.append(_Written(band, file, start, handle.tell() - start))
            advance(progress, tensor.numel() * tensor.element_size())
        for key, value in values.items():
            start = handle.tell()
            torch.save(value, handle)
            written.append(_Written(_Band(key, "", "value", (), "uint8", 0, 0, None, {}), file, start, handle.tell() - start))
    stored.check_partial_reads()
    return written


def _metadata(written: list[_Written], directory: str, path_of) -> dcp_metadata.Metadata:
    """DCP's own records for what the writers wrote."""
    tensors: dict[str, list[_Written]] = {}
    for entry in written:
        if entry.band.kind != "value":
            tensors.setdefault(entry.band.key, []).append(entry)
    state, storage, planner = {}, {}, {}
    for key, entries in tensors.items():
        entries.sort(key=lambda entry: entry.band.first)
        band = entries[0].band
        chunks = []
        for index, entry in enumerate(entries):
            b = entry.band
            offsets = torch.Size((b.first,) + (0,) * (len(b.shape) - 1) if b.shape else ())
            sizes = torch.Size((b.end - b.first, *b.shape[1:]) if b.shape else ())
            chunks.append(dcp_metadata.ChunkStorageMetadata(offsets=offsets, sizes=sizes))
            storage[dcp_metadata.MetadataIndex(key, offsets, index)] = dcp_filesystem._StorageInfo(entry.file, entry.start,
                                                                                                   entry.length)
        state[key] = dcp_metadata.TensorStorageMetadata(
            properties=dcp_metadata.TensorProperties(dtype=getattr(torch, band.dtype)), size=torch.Size(band.shape),
            chunks=chunks)
        planner[key] = path_of(key)
    for entry in written:
        if entry.band.kind == "value":
            state[entry.band.key] = dcp_metadata.BytesStorageMetadata()
            storage[dcp_metadata.MetadataIndex(entry.band.key)] = dcp_filesystem._StorageInfo(entry.file, entry.start,
                                                                                             entry.length)
            planner[entry.band.key] = path_of(entry.band.key)
    return dcp_metadata.Metadata(state_dict_metadata=state, planner_data=planner, storage_data=storage,
                                 storage_meta=dcp_metadata.StorageMeta(checkpoint_id=directory, save_id=uuid.uuid4().hex),
                                 version=dcp_filesystem.CURRENT_DCP_VERSION)


def _path(key: str) -> tuple[str, ...]:
    """The key's place in the nested state dict torchtitan saves (DCP's planner_data)."""
    if key.startswith(OPTIMIZER + "."):
        return (OPTIMIZER, key[len(OPTIMIZER) + 1:])
    if key == TRAIN_STEP:
        return ("train_state", "step")
    return (key,)


def _saved_path(key: str) -> tuple[str, ...]:
    """The key's place in the state dict a `rayshard.checkpoint` save was given, as far as its
    flattened key tells: `{"model": {fqn: ...}, "optim": {"state": {fqn: {state: ...}}, ...}}` as
    `get_state_dict` gives; anything else one key at the top (DCP's planner_data; a load that
    brings its own state dict does not use it)."""
    name, kind = column_of(key)
    if kind == PARAM:
        return ("model", name)
    if kind != OTHER_KIND:
        return ("optim", "state", name, kind)
    if key.startswith("optim."):
        return ("optim", key[len("optim."):])
    return (key,)
