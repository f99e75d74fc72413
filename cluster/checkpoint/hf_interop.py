"""Hugging Face interop: export a checkpoint as a transformers directory of its family (Llama,
Qwen2, Qwen3, Mistral, Qwen2-MoE, Qwen3-MoE: `plans/interop/hf_families.py`; a user model by
its plan's mapping), import one back.

One mapping per family (`hf_mapping`), or a user plan's, is written in the export direction; import
uses its derived inverse. A user model's export imports back only with its `rayshard.json` (the
record naming its factory and plan): config.json alone names no family rayshard computes.
Export writes `config.json` (with the bos / eos / pad ids: the model's, else its tokenizer's),
`generation_config.json` (those ids, so `generate()` stops at eos) and `model.safetensors` (or
`model-0000i-of-0000n.safetensors` plus `model.safetensors.index.json` past `max_shard_bytes`),
and, unless asked not to, the optimizer
moments under the same names in `rayshard-optimizer/` (Hugging Face ignores the folder) and the
run metadata in `rayshard.json`, so `import(export(ckpt))` restores the very same training state.

Both directions stream one mapping group at a time (a layer's fused qkv and its q, k, v, for
example): memory is bounded by the largest group, never the whole model.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import fsspec
import torch

from rayshard.actors.checkpoint.shard_writer import LazyTensor, Piece, write_shard

from rayshard.cluster.checkpoint.described_source import open_source
from rayshard.cluster.checkpoint.export_directory import published_when_done, refuse_non_empty, staged_url
from rayshard.cluster.progress import advance, set_total
from rayshard.cluster.catalog import writer_lease
from rayshard.cluster.checkpoint.transform_exec import Adjust, run_group
from rayshard.cluster.data.tokenizer import (TOKENIZER_CONFIG, TOKENIZER_JSON, copy_tokenizer_files, load_tokenizer,
                                             special_tokens_of, tokenizer_url_of)
from rayshard.plans.checkpoint.chunks import EXP_AVG, EXP_AVG_SQ, PARAM
from rayshard.plans.errors import CheckpointError, RayshardError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.checkpoint.model_check import check_against_own_model, raise_if_mismatched
from rayshard.plans.interop.model_description import ModelDescription
from rayshard.plans.training.model_spec import ModelConfig, parameter_shapes
from rayshard.plans.training.special_tokens import SpecialTokens
from rayshard.plans.checkpoint.safetensors_layout import DTYPE_NAMES, ITEMSIZE, Entry, file_layout, parse_header
from rayshard.plans.interop.hf_families import export_config, export_mapping, hub_names, model_config_from_hf
from rayshard.plans.transforms.mapping import Cast, Mapping, MappingPlan, Meta, Unalias, UnmappedTensors

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
GENERATION_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")  # transformers' GenerationConfig names
WEIGHTS = "model"
OPTIMIZER_DIR = "rayshard-optimizer"
RUN_METADATA = "rayshard.json"
DEFAULT_SHARD_BYTES = 2 * 2**30
IMPORT_FILE_BYTES = 2 * 2**30
MOMENTS = (EXP_AVG, EXP_AVG_SQ)


# ---- streaming a mapping plan -------------------------------------------------------------------


class GroupStream:
    """Hands out a plan's outputs one by one, computing each group once, when first asked, and
    forgetting it once all its outputs are handed out (outputs are requested group by group)."""

    def __init__(self, plan: MappingPlan, load_source: Callable[[str], torch.Tensor], adjust: Adjust | None = None):
        self.plan, self.load_source, self.adjust = plan, load_source, adjust
        self.group_of = plan.group_of()
        self.ready: dict[str, torch.Tensor] = {}

    def order(self) -> list[str]:
        return [name for group in self.plan.groups for name in group.outputs]

    def take(self, name: str) -> torch.Tensor:
        if name not in self.ready:
            group = self.group_of[name]
            self.ready.update(run_group(group, {source: self.load_source(source) for source in group.sources}, self.adjust))
        return self.ready.pop(name)

    def check_ties(self) -> None:
        """Run now, and forget, each group that checks a tied copy (a file holding both
        `lm_head.weight` and the embedding it should equal): an import refuses a copy that differs
        before it writes anything, not halfway through. Rare (save_pretrained leaves the copy out),
        so the extra read of the two tensors is paid only where the file holds both."""
        for group in self.plan.groups:
            if any(isinstance(step.rule, Unalias) for step in group.steps):
                run_group(group, {source: self.load_source(source) for source in group.sources})


def write_safetensors_files(fs, directory: str, prefix: str, outputs: dict[str, Meta], stream: GroupStream,
                             max_shard_bytes: int, progress=None) -> list[str]:
    """Write outputs in stream order into one file, or shards plus a Hugging Face index."""
    files: list[list[str]] = [[]]
    size = 0
    for name in stream.order():
        nbytes = Entry(name, outputs[name].dtype, outputs[name].shape).nbytes
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    names = ([f"{prefix}.safetensors"] if len(files) == 1 else
             [f"{prefix}-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    fs.makedirs(f"{directory}/{prefix}".rsplit("/", 1)[0], exist_ok=True)
    for file, members in zip(names, files):
        entries = [Entry(name, outputs[name].dtype, outputs[name].shape) for name in members]
        header, _ = file_layout(entries, {"format": "pt"})
        with fs.open(f"{directory}/{file}", "wb") as handle:
            handle.write(header)
            for name in members:
                tensor = stream.take(name).contiguous()
                handle.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
                advance(progress, tensor.numel() * tensor.element_size())
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(Entry(n, m.dtype, m.shape).nbytes for n, m in outputs.items())},
                 # Paths relative to the index's own folder, as transformers expects.
                 "weight_map": {name: file.rsplit("/", 1)[-1] for file, members in zip(names, files) for name in members}}
        fs.pipe_file(f"{directory}/{prefix}.safetensors.index.json", json.dumps(index, indent=2).encode())
    return names


@dataclass
class ExportResult:
    directory: str
    files: list[str]
    tensors: int
    seconds: float


def export_hf(checkpoint_url: str, directory: str, dtype: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              include_optimizer: bool = True, log=print, progress=None,
              description: ModelDescription | None = None) -> ExportResult:
    """progress: a bar (cluster/progress.py) advanced by the bytes of each tensor written.
    description: the model a `rayshard.checkpoint` checkpoint holds, and its naming
    (`described_source.py`); else the one it recorded at save."""
    started = time.perf_counter()
    fs, base = empty_export_directory(directory)
    stored = open_source(checkpoint_url, description)
    model = check_against_own_model(stored.chunks, stored.metadata, checkpoint_url)
    if stored.metadata.get("lora"):  # the adapters alone: no Hugging Face model's weights
        raise CheckpointError(f"{checkpoint_url}: is a LoRA run's checkpoint, which holds its adapters, not a model. Fix: "
                              "export the adapters with --format peft, or the model with them merged with --format hf --merge")
    stored_kinds = {kind for _, kind in stored.index}
    kinds = [PARAM] + ([k for k in MOMENTS if k in stored_kinds] if include_optimizer else [])
    plans = []
    for kind in kinds:
        metas = {name: Meta(chunks[0].global_shape, chunks[0].dtype)
                 for (name, k), chunks in stored.tensors().items() if k == kind}
        # Weights take the requested dtype; moments keep theirs (they are ours, not Hugging Face's).
        stored_dtype = next(iter(metas.values())).dtype if metas else "float32"
        mapping = export_mapping(model, dtype if kind == PARAM else None, source_dtype=stored_dtype)
        plans.append((kind, metas, mapping.plan(metas)))
    if not plans[0][1]:
        raise CheckpointError(f"{checkpoint_url}: holds no model parameters (kind 'param') to export; the manifest is "
                              "damaged. Fix: export another checkpoint (`rayshard ckpt ls`)")
    set_total(progress, sum(Entry(name, meta.dtype, meta.shape).nbytes for *_, plan in plans for name, meta in plan.outputs.items()))
    written = []
    with published_when_done(fs, base, directory) as staging:
        for kind, metas, plan in plans:
            stream = GroupStream(plan, lambda name, kind=kind, metas=metas: stored.read_region(
                name, kind, (0,) * len(metas[name].shape), metas[name].shape))
            prefix = WEIGHTS if kind == PARAM else f"{OPTIMIZER_DIR}/{kind}"
            written += write_safetensors_files(fs, staging, prefix, plan.outputs, stream, max_shard_bytes, progress)
        stored.check_partial_reads()  # none today (whole tensors read whole chunks); any part would be checked here
        out_dtype = dtype or next(iter(stored.chunks)).dtype
        written += write_model_files(fs, staging, staged_url(staging, base, directory), model, stored.metadata, out_dtype, log)
        fs.pipe_file(f"{staging}/{RUN_METADATA}", json.dumps({"source": checkpoint_url, "metadata": stored.metadata,
                                                              "weights_dtype": out_dtype}, indent=2, default=str).encode())
    result = ExportResult(directory, written, sum(1 for _ in stored.tensors()), time.perf_counter() - started)
    log(f"exported {checkpoint_url} to {directory}: {len(written)} safetensors file(s) in {result.seconds:.1f}s")
    return result


def empty_export_directory(directory: str):
    """(fs, path) of an export's --out, refused when it names nothing or already holds files."""
    fs, base = fsspec.core.url_to_fs(directory) if directory.strip() else (None, "")
    if fs is None:
        raise CheckpointError("export --out is empty. Fix: name a new directory, e.g. --out ./hf-export")
    base = base.rstrip("/")
    refuse_non_empty(fs, base, directory)
    return fs, base


def write_model_files(fs, base: str, directory: str, model: ModelConfig, metadata: dict, out_dtype: str, log) -> list[str]:
    """Beside the weights: the run's tokenizer (it travels with its weights), config.json and
    generation_config.json. Returns the tokenizer files copied."""
    tokenizer_url = tokenizer_url_of(metadata)
    copied = copy_tokenizer_files(tokenizer_url, directory) if tokenizer_url else []
    config = export_config(model, out_dtype)
    # The ids generate() stops at: the model's own (imported with it), else its tokenizer's; a
    # user plan's config.json keeps any it names.
    tokens = model.special_tokens or (_tokenizer_special_tokens(directory, log) if TOKENIZER_JSON in copied else None)
    for key, value in (tokens.hf_fields() if tokens else {}).items():
        config.setdefault(key, value)
    fs.pipe_file(f"{base}/{CONFIG}", json.dumps(config, indent=2).encode())
    generation = {key: config[key] for key in GENERATION_FIELDS if config.get(key) is not None}
    if generation:
        fs.pipe_file(f"{base}/{GENERATION_CONFIG}", json.dumps(generation, indent=2).encode())
    return copied


def _tokenizer_special_tokens(directory: str, log) -> SpecialTokens | None:
    """The copied tokenizer's ids; one without an end-of-document token gives none (noted)."""
    try:
        return special_tokens_of(load_tokenizer(directory))
    except RayshardError as error:
        log(f"note: no bos/eos ids written to {CONFIG}: {error}")
        return None


# ---- import -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    file: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def read_safetensors_index(fs, base: str, prefix: str) -> dict[str, StoredTensor]:
    """Every tensor of `prefix`'s safetensors file(s): from the index when sharded, by headers."""
    index_path = f"{base}/{prefix}.safetensors.index.json"
    if fs.exists(index_path) and fs.exists(f"{base}/{prefix}.safetensors"):
        raise CheckpointError(f"{base}: holds both {prefix}.safetensors and {prefix}.safetensors.index.json, so one is "
                              "left from another export. Fix: export again into an empty directory")
    if fs.exists(index_path):
        weight_map = read_json_object(fs, index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index_path}: has no weight_map of tensor names to file names; the index is damaged. "
                                  "Fix: restore it, or delete it and keep a single model.safetensors")
        files = sorted(set(weight_map.values()))
        files = [f"{prefix.rsplit('/', 1)[0]}/{f}" if "/" in prefix else f for f in files]
    elif fs.exists(f"{base}/{prefix}.safetensors"):
        files = [f"{prefix}.safetensors"]
    else:
        return {}
    tensors = {}
    for file in files:
        path = f"{base}/{file}"
        if not fs.exists(path):
            raise CheckpointError(f"{path}: listed in the index but missing")
        size = fs.size(path)
        head = fs.cat_file(path, start=0, end=8)
        length = int.from_bytes(head[:8], "little") if len(head) == 8 else 0
        if 8 + length > size:  # read nothing a damaged length asks for (it may say terabytes)
            raise CheckpointError(f"{path}: its header claims {length} bytes but the file has {size}; it is truncated "
                                  "or not safetensors. Fix: export or download it again")
        header, data_start = parse_header(fs.cat_file(path, start=0, end=8 + length), path)
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: its safetensors header is not a JSON object; the file is damaged")
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            tensors[name] = _stored_tensor(file, path, name, entry, data_start, size)
    return tensors


def _stored_tensor(file: str, path: str, name: str, entry, data_start: int, size: int) -> StoredTensor:
    """One entry of a safetensors header, checked: a known dtype, a shape of whole numbers, and
    data offsets inside the file that hold exactly the shape's elements."""
    def damaged(problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: {name}: {problem}; the file is damaged. Fix: export or download it again")
    if not isinstance(entry, dict):
        raise damaged("its header entry is not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"{path}: {name} has dtype {dtype!r}, which rayshard cannot import "
                              f"(it imports {', '.join(DTYPE_NAMES)})")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise damaged(f"its shape {shape!r} is not a list of whole numbers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(n, int) for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise damaged(f"its data_offsets {offsets!r} are not [start, end]")
    start, end = offsets
    if data_start + end > size:
        raise CheckpointError(f"{path}: {name} needs bytes [{data_start + start}, {data_start + end}) but the file "
                              f"has {size}; it is truncated")
    elements = 1
    for extent in shape:
        elements *= extent
    if end - start != elements * ITEMSIZE[DTYPE_NAMES[dtype]]:
        raise damaged(f"its {end - start} bytes do not hold shape {shape} of {DTYPE_NAMES[dtype]}")
    return StoredTensor(file, DTYPE_NAMES[dtype], tuple(shape), data_start + start, data_start + end)


# A config.json is a few KiB, a sharded model's index a few MiB.
MAX_JSON_BYTES = 256 * 2**20


def read_json_object(fs, path: str) -> dict:
    """A JSON file that must hold an object (config.json, an index, rayshard.json), or a
    CheckpointError naming the file."""
    kind = fs.info(path).get("type")
    if kind != "file":  # a FIFO or a device (a link to /dev/zero) may never end
        raise CheckpointError(f"{path}: is not a regular file ({kind}). Fix: pass the model's own config.json (or index)")
    with fs.open(path, "rb") as handle:  # at most one byte past the bound
        text = handle.read(MAX_JSON_BYTES + 1)
    if len(text) > MAX_JSON_BYTES:
        raise CheckpointError(f"{path}: holds more than {MAX_JSON_BYTES} bytes, more than any configuration or index "
                              "rayshard reads. Fix: pass the model's own config.json (or index)")
    try:
        document = json.loads(text)
    except ValueError as error:  # bad JSON, bad UTF-8
        raise CheckpointError(f"{path}: is not valid JSON ({error}). Fix: restore the file, or export again") from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(document).__name__}, not an object. Fix: restore the file, "
                              "or export again")
    return document


def tensor_reader(fs, base: str, tensors: dict[str, StoredTensor]):
    def load(name: str) -> torch.Tensor:
        entry = tensors[name]
        data = fs.cat_file(f"{base}/{entry.file}", start=entry.start, end=entry.end)
        if len(data) != entry.end - entry.start:
            raise CheckpointError(f"{base}/{entry.file}: expected bytes [{entry.start}, {entry.end}) of {name}, got {len(data)}")
        return torch.frombuffer(bytearray(data), dtype=getattr(torch, entry.dtype)).reshape(entry.shape)
    return load


def import_hf(directory: str, store, run: str, dtype: str = "float32", file_bytes: int = IMPORT_FILE_BYTES,
              log=print, progress=None) -> str:
    """Write a rayshard checkpoint (run@step) from a Hugging Face directory of a family we compute; commit it.
    progress: a bar (cluster/progress.py) advanced by the bytes of each tensor handed to the writer.
    The directory is read and checked first, so a refusal leaves the store untouched (no run, no
    lease); the writing holds the run's writer lease, as every writer of a run does."""
    prepared = _prepare_hf_import(directory, dtype, log)
    store.refuse_committed(run, prepared.step, "import into another --run, or remove that run first")
    with writer_lease.holding(store, run):
        return _write_hf_import(prepared, directory, store, run, dtype, file_bytes, log, progress)


@dataclass(frozen=True)
class _PreparedHfImport:
    """A Hugging Face directory read and checked against the model its config.json describes:
    what the import writes, before anything is written."""

    model: ModelConfig
    saved: dict  # the run metadata a rayshard export wrote beside the weights ({} when absent)
    streams: dict  # kind -> (GroupStream, MappingPlan)
    step: int


def _prepare_hf_import(directory: str, dtype: str, log) -> _PreparedHfImport:
    fs, base = fsspec.core.url_to_fs(directory)
    config_path = f"{base}/{CONFIG}"
    if not fs.exists(config_path):
        raise CheckpointError(f"{directory}: no {CONFIG}; pass a Hugging Face model directory")
    saved = read_json_object(fs, f"{base}/{RUN_METADATA}") if fs.exists(f"{base}/{RUN_METADATA}") else {}
    if not isinstance(saved.get("metadata") or {}, dict):
        raise CheckpointError(f"{base}/{RUN_METADATA}: its metadata is not a JSON object. Fix: restore the file, or "
                              "delete it to import the weights alone")
    model = _model_of(read_json_object(fs, config_path), config_path, saved)
    read = read_safetensors_index(fs, base, WEIGHTS)
    weights = hub_names(model, read)
    if model.family == "gemma3" and len(weights) < len(read):  # decision 145
        log(f"{directory}: Gemma3ForConditionalGeneration: importing its text model (family gemma3, exported as "
            f"Gemma3ForCausalLM); its vision tower and projector ({len(read) - len(weights)} tensors) are left out")
    if not weights:
        raise CheckpointError(f"{directory}: no {WEIGHTS}.safetensors or {WEIGHTS}.safetensors.index.json")
    if model.n_layers > len(weights):  # before listing the model's tensors: a damaged count may say billions
        raise CheckpointError(f"{config_path}: says {model.n_layers} layers but the weights hold {len(weights)} "
                              "tensors in all. Fix: import a directory whose config.json matches its weights")
    shapes = parameter_shapes(model)
    streams: dict[str, tuple[GroupStream, MappingPlan]] = {}
    for kind, tensors in [(PARAM, weights)] + [(k, read_safetensors_index(fs, base, f"{OPTIMIZER_DIR}/{k}")) for k in MOMENTS]:
        if not tensors:
            continue
        hf_dtypes = {t.dtype for t in tensors.values()}
        if len(hf_dtypes) != 1:
            raise CheckpointError(f"{directory} ({kind}): tensors mix dtypes {sorted(hf_dtypes)}; rayshard imports one dtype")
        mapping = export_mapping(model).inverse()
        source_dtype = hf_dtypes.pop()
        if source_dtype != dtype:  # e.g. bfloat16 weights trained on in float32
            mapping = Mapping(mapping.rules + (Cast("*", to=dtype, source=source_dtype),))
        try:
            plan = mapping.plan({name: Meta(t.shape, t.dtype) for name, t in tensors.items()})
        except UnmappedTensors as error:
            names = error.names
            raise CheckpointError(f"{directory} ({kind}): holds {len(names)} tensor(s) the model its config.json describes "
                                  f"has no place for: {', '.join(names[:10])}{' ...' if len(names) > 10 else ''}. Fix: import "
                                  "a directory whose config.json matches its weights") from None
        expected = {(name, kind): (tuple(shape), dtype) for name, shape in shapes.items()}
        found = {(name, kind): (meta.shape, meta.dtype) for name, meta in plan.outputs.items()}
        raise_if_mismatched(expected, found, set(expected), f"{directory} ({kind})",
                            fix="import a directory whose config.json matches its weights")
        streams[kind] = (GroupStream(plan, tensor_reader(fs, base, tensors)), plan)
        streams[kind][0].check_ties()
    if fs.exists(f"{base}/{TOKENIZER_CONFIG}"):  # kept with the run: every later export reads it
        read_json_object(fs, f"{base}/{TOKENIZER_CONFIG}")
    step = (saved.get("metadata") or {}).get("step", 0)
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{base}/{RUN_METADATA}: its step {step!r} is not a whole number. Fix: restore the file, "
                              "or delete it to import the weights alone")
    return _PreparedHfImport(model, saved, streams, step)


def _write_hf_import(prepared: _PreparedHfImport, directory, store, run, dtype, file_bytes, log, progress) -> str:
    model, saved, streams, step = prepared.model, prepared.saved, prepared.streams, prepared.step
    shapes = parameter_shapes(model)
    store.refuse_committed(run, step, "import into another --run, or remove that run first")  # again: now we hold the run
    pending = store.begin(run, step)
    pieces = []
    for kind in (PARAM, *MOMENTS):
        if kind in streams:
            stream, plan = streams[kind]
            for name in stream.order():
                pieces.append((name, kind, LazyTensor(getattr(torch, dtype), shapes[name], lambda s=stream, n=name: s.take(n))))
        else:  # no moments exported: a fresh optimizer (AdamW with zero moments is exactly that)
            for name, shape in shapes.items():
                pieces.append((name, kind, LazyTensor(getattr(torch, dtype), shape, lambda s=shape: torch.zeros(s, dtype=getattr(torch, dtype)))))
    set_total(progress, sum(_nbytes(lazy.shape, ITEMSIZE[dtype]) for _, _, lazy in pieces))
    pieces = [(name, kind, LazyTensor(lazy.dtype, lazy.shape, _counted(lazy, progress))) for name, kind, lazy in pieces]
    chunks = []
    target_fs, target_base = fsspec.core.url_to_fs(pending.url)
    for number, members in enumerate(_split_by_bytes(pieces, file_bytes, ITEMSIZE[dtype])):
        chunks += write_shard(target_fs, target_base, pending.file_for(number, stem="import"),
                              [Piece(name, kind, lazy, lazy.shape, (0,) * len(lazy.shape)) for name, kind, lazy in members])
    metadata = dict(saved.get("metadata") or {})
    metadata.pop("format_version", None)
    metadata.update(run=run, step=step, model=model.to_dict(), layout=ParallelLayout().to_dict(),
                    parent=None, imported_from=directory, created_unix=time.time())
    metadata.setdefault("model_preset", None)
    kept = f"{store.url}/{run}/tokenizer"  # its tokenizer stays with the run: `data prepare --tokenizer` reads it
    if copy_tokenizer_files(directory, kept):
        metadata["tokenizer_url"] = kept
    committed = pending.commit(chunks, metadata)
    log(f"imported {directory} as {run}@{step}: {committed}")
    return committed


def _model_of(config: dict, config_path: str, saved: dict) -> ModelConfig:
    """A family's model from config.json; a user model (which has no family) only from the run
    metadata a rayshard export wrote beside it, whose plan holds the mapping it was written with."""
    recorded = (saved.get("metadata") or {}).get("model") or {}
    if recorded.get("user") is not None:
        return ModelConfig.from_dict(recorded).validate()
    return model_config_from_hf(config, config_path)


def _nbytes(shape, itemsize: int) -> int:
    count = itemsize
    for extent in shape:
        count *= extent
    return count


def _counted(lazy: LazyTensor, progress):
    def load() -> torch.Tensor:
        tensor = lazy.load()
        advance(progress, tensor.numel() * tensor.element_size())
        return tensor
    return load


def _split_by_bytes(pieces, limit: int, itemsize: int):
    group, size = [], 0
    for piece in pieces:
        count = _nbytes(piece[2].shape, itemsize)
        if group and size + count > limit:
            yield group
            group, size = [], 0
        group.append(piece)
        size += count
    if group:
        yield group
