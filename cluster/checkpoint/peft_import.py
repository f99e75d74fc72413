"""A PEFT LoRA adapter directory into rayshard: a LoRA run's checkpoint naming its base.

`import_peft(DIR, store, run, base)` reads `adapter_config.json` (r, lora_alpha, lora_dropout,
target_modules: `plans/interop/peft_adapters.py` refuses what our adapters do not compute) and
`adapter_model.safetensors` (PEFT's keys, mapped to ours by the export mapping's inverse), checks
every adapter's shape against the base's model and commits `run@0`: the adapters in float32 (a
LoRA run trains them in float32, decision 126) with zero AdamW moments (a fresh optimizer, which a
PEFT directory does not carry), and the manifest's `lora` and `lora_base` {url, seed, digest} as a
LoRA run writes them (decision 125), so `rayshard train --resume RUN` continues it on any layout,
with the base's digest checked at every start.

The base must be the checkpoint the adapter was trained on. What can be checked is: every
adapter's shape against the base's projections, the base's family (PEFT's modules per
projection), the model at `base_model_name_or_path` where that names a local Hugging Face
directory (its config.json against the base's model), and, for a directory rayshard exported,
the base digest it recorded.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import fsspec
import torch

from rayshard.actors.checkpoint.shard_writer import LazyTensor, Piece, write_shard
from rayshard.cluster.catalog import writer_lease
from rayshard.cluster.checkpoint.digest import weights_digest
from rayshard.cluster.checkpoint.hf_interop import (CONFIG, MOMENTS, RUN_METADATA, GroupStream, tensor_reader,
                                                    read_json_object, read_safetensors_index)
from rayshard.cluster.progress import counted, set_total
from rayshard.plans.checkpoint.chunks import PARAM
from rayshard.plans.checkpoint.model_check import check_against_own_model
from rayshard.plans.config import LoraConfig
from rayshard.plans.errors import CheckpointError
from rayshard.plans.interop.hf_families import model_config_from_hf
from rayshard.plans.interop.peft_adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PICKLED_WEIGHTS, lora_settings,
                                                  peft_mapping, refuse_unexportable, refuse_unknown_keys)
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.lora import adapter_shapes
from rayshard.plans.training.model_spec import ModelConfig, model_differences
from rayshard.plans.transforms.mapping import Cast, Mapping, Meta
from rayshard.storage.manifest_io import read_manifest

ADAPTER_DTYPE = "float32"


def import_peft(directory: str, store, run: str, base_url: str, log=print, progress=None) -> str:
    """Commit `run@0` from a PEFT adapter directory on the base checkpoint `base_url` (committed;
    the caller holds a reader lease on it). The adapter and the base are read and checked first, so
    a refusal leaves the store untouched (no run, no lease); the writing holds the run's writer
    lease, as every writer of a run does."""
    prepared = _prepare_peft_import(directory, base_url)
    store.refuse_committed(run, 0, "import into another --run, or remove that run first")
    with writer_lease.holding(store, run):
        return _write_peft_import(prepared, directory, store, run, base_url, log, progress)


@dataclass(frozen=True)
class _PreparedPeftImport:
    """An adapter directory read and checked against its base: what the import writes."""

    model: ModelConfig  # the base's
    base_metadata: dict
    lora: LoraConfig
    shapes: dict  # adapter name -> shape
    stream: GroupStream
    digest: str  # the base's weights digest, recorded in the LoRA run's manifest


def _prepare_peft_import(directory: str, base_url: str) -> _PreparedPeftImport:
    fs, path = fsspec.core.url_to_fs(directory)
    path = path.rstrip("/")
    config_path = f"{path}/{ADAPTER_CONFIG}"
    if not fs.exists(config_path):
        hint = ("it is a model directory: import it with --format hf" if fs.exists(f"{path}/{CONFIG}")
                else "pass the directory PeftModel.save_pretrained wrote")
        raise CheckpointError(f"{directory}: no {ADAPTER_CONFIG}, so it is no PEFT adapter. Fix: {hint}")
    adapter_settings = read_json_object(fs, config_path)
    settings = lora_settings(adapter_settings, config_path)
    tensors = read_safetensors_index(fs, path, ADAPTER_WEIGHTS)
    if not tensors:
        pickled = fs.exists(f"{path}/{PICKLED_WEIGHTS}")
        raise CheckpointError(f"{directory}: no {ADAPTER_WEIGHTS}.safetensors"
                              + (f" (only {PICKLED_WEIGHTS}, a pickle, which rayshard never loads). Fix: save the adapter "
                                 "with PeftModel.save_pretrained(..., safe_serialization=True)" if pickled else
                                 ". Fix: pass the directory PeftModel.save_pretrained wrote"))
    chunks, base_metadata = read_manifest(base_url)
    if base_metadata.get("lora"):
        recorded = (base_metadata.get("lora_base") or {}).get("url")
        raise CheckpointError(f"--base {base_url}: is a LoRA run's checkpoint (adapters only), not a model. Fix: name the "
                              f"checkpoint holding the base weights{f' ({recorded})' if recorded else ''}")
    model = check_against_own_model(chunks, base_metadata, base_url)
    refuse_unexportable(model, f"--base {base_url}", "import the adapter onto a Llama, Qwen2, Qwen3, Mistral, Qwen2-MoE, Qwen3-MoE or Mixtral base")
    _refuse_another_hf_base(adapter_settings.get("base_model_name_or_path"), model, config_path)
    refuse_unknown_keys(tensors, model, f"{path}/{ADAPTER_WEIGHTS}.safetensors")
    lora = LoraConfig(rank=settings["rank"], alpha=settings["alpha"], dropout=settings["dropout"],
                      targets=settings["targets"], base=base_url)
    lora.validate()
    dtypes = {t.dtype for t in tensors.values()}
    if len(dtypes) != 1:
        raise CheckpointError(f"{directory}: its adapter tensors mix dtypes {sorted(dtypes)}; rayshard imports one dtype. "
                              "Fix: save the adapter in one dtype")
    source_dtype = dtypes.pop()
    mapping = peft_mapping(lora.target_list).inverse()
    if source_dtype != ADAPTER_DTYPE:  # adapters train in float32 whatever the run's precision
        mapping = Mapping(mapping.rules + (Cast("*", to=ADAPTER_DTYPE, source=source_dtype),))
    plan = mapping.plan({name: Meta(t.shape, t.dtype) for name, t in tensors.items()})
    shapes = adapter_shapes(model, lora.rank, lora.target_list)
    _refuse_other_shapes(shapes, plan.outputs, lora, directory, base_url)
    digest = weights_digest(base_url)
    _refuse_another_recorded_base(fs, f"{path}/{RUN_METADATA}", digest, base_url)
    stream = GroupStream(plan, tensor_reader(fs, path, tensors))
    return _PreparedPeftImport(model, base_metadata, lora, shapes, stream, digest)


def _write_peft_import(prepared: _PreparedPeftImport, directory, store, run, base_url, log, progress) -> str:
    model, base_metadata, lora, shapes, stream, digest = (prepared.model, prepared.base_metadata, prepared.lora,
                                                          prepared.shapes, prepared.stream, prepared.digest)
    dtype = getattr(torch, ADAPTER_DTYPE)
    pieces = [(name, PARAM, lambda n=name: stream.take(n)) for name in stream.order()]
    pieces += [(name, kind, lambda s=shape: torch.zeros(s, dtype=dtype)) for kind in MOMENTS for name, shape in shapes.items()]
    set_total(progress, sum(4 * math.prod(shapes[name]) for name, _, _ in pieces))
    store.refuse_committed(run, 0, "import into another --run, or remove that run first")  # again: now we hold the run
    pending = store.begin(run, 0)
    target_fs, target_base = fsspec.core.url_to_fs(pending.url)
    written = write_shard(target_fs, target_base, pending.file_for(0, stem="import"),
                          [Piece(name, kind, LazyTensor(dtype, shapes[name], counted(load, progress)), shapes[name],
                                 (0,) * len(shapes[name])) for name, kind, load in pieces])
    metadata = {"run": run, "step": 0, "model": model.to_dict(), "model_preset": base_metadata.get("model_preset"),
                "layout": ParallelLayout().to_dict(), "parent": None, "imported_from": directory,
                "created_unix": time.time(), "lora": asdict(lora),
                "lora_base": {"url": base_url, "seed": 0, "digest": digest}}
    committed = pending.commit(written, metadata)
    log(f"imported the PEFT adapter {directory} (r={lora.rank}, alpha={lora.alpha:g}, targets {lora.targets}) on "
        f"{base_url} as {run}@0: {committed}")
    return committed


def _refuse_other_shapes(shapes: dict, found: dict[str, Meta], lora: LoraConfig, directory: str, base_url: str) -> None:
    """Every adapter the settings name, at the shape the base's projection gives it; in one line."""
    missing = sorted(set(shapes) - set(found))
    unexpected = sorted(set(found) - set(shapes))
    other = [f"{name} {list(found[name].shape)} (the base's: {list(shape)})" for name, shape in shapes.items()
             if name in found and tuple(found[name].shape) != tuple(shape)]
    problems = ([f"{len(other)} adapter(s) of other shapes: {'; '.join(other[:3])}{' ...' if len(other) > 3 else ''}"]
                if other else [])
    problems += [f"{label} ({len(names)}): {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                 for label, names in (("missing", missing), ("unexpected", unexpected)) if names]
    if problems:
        raise CheckpointError(f"{directory}: does not fit --base {base_url} (r={lora.rank}, targets {lora.targets}): "
                              f"{'; '.join(problems)}. Fix: import the adapter onto the base it was trained on")


def _refuse_another_hf_base(named, model, where: str) -> None:
    """base_model_name_or_path, where it is a local Hugging Face directory, must hold the base's model."""
    if not isinstance(named, str) or not named or "://" in named:
        return  # none, or a URL whose store this command may hold no credentials for
    fs = fsspec.filesystem("file")
    config_path = f"{named.rstrip('/')}/{CONFIG}"
    if not fs.exists(config_path):
        return  # a Hub id, or a directory not on this machine: nothing to compare
    try:
        named_model = model_config_from_hf(read_json_object(fs, config_path), config_path)
    except CheckpointError:
        return  # not a model rayshard computes: the shapes below still decide
    differences = [d for d in model_differences(model, named_model) if not d.startswith("max_seq_len")]
    if differences:
        raise CheckpointError(f"{where}: base_model_name_or_path {named} is a model that differs from --base in "
                              f"{', '.join(differences[:4])}; the adapter was trained on another model. Fix: pass the "
                              "--base imported from that directory")


def _refuse_another_recorded_base(fs, path: str, digest: str, base_url: str) -> None:
    """A directory rayshard exported names the digest of its adapters' base: it must be this base's."""
    if not fs.exists(path):
        return
    recorded = (read_json_object(fs, path).get("lora_base") or {})
    if isinstance(recorded, dict) and recorded.get("digest") not in (None, digest):
        raise CheckpointError(f"{path}: the adapter was trained on {recorded.get('url')} with weight digest "
                              f"{str(recorded.get('digest'))[:19]}..., but --base {base_url} has {digest[:19]}.... Fix: "
                              f"pass --base {recorded.get('url')} (or the checkpoint holding the same weights)")


