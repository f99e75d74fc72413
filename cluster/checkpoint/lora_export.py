"""A LoRA run's checkpoint out of rayshard: the adapters as a PEFT directory, or the model merged.

- `export_peft`: `adapter_model.safetensors` (PEFT's keys, `plans/interop/peft_adapters.py`) and
  `adapter_config.json` (r, lora_alpha, lora_dropout, target_modules: the run's), which
  `PeftModel.from_pretrained(base, DIR)` loads onto the Hugging Face export of the base or the
  directory the base was imported from. `rayshard.json` beside them names the checkpoint and its
  base (URL and weight digest), so an import of the directory can check the base it is given.
  MoE families and users' models map as `plans/interop/peft_adapters.py` says (decision 169).
- `export_merged`: the Hugging Face directory of the base (`hf_interop.py`'s mapping, config.json,
  tokenizer) with each adapted projection's weight replaced by W + (alpha / r) B A, computed in
  float32 from the stored values and only then cast to the export dtype. The base is the one the
  checkpoint names, checked against its recorded digest first (one streaming read): adapters
  merged into other weights would be a silently different model.

Both stream one tensor (one mapping group) at a time, by region reads, as the Hugging Face export
does: the adapters of a projection are read when its weight is written.
"""
from __future__ import annotations

import json
import time

import torch

from rayshard.cluster.checkpoint.described_source import open_source
from rayshard.cluster.checkpoint.digest import weights_digest
from rayshard.cluster.checkpoint.export_directory import published_when_done, staged_url
from rayshard.cluster.checkpoint.hf_interop import (DEFAULT_SHARD_BYTES, RUN_METADATA, WEIGHTS, ExportResult, GroupStream,
                                                    write_safetensors_files, empty_export_directory, write_model_files)
from rayshard.cluster.progress import set_total
from rayshard.plans.checkpoint.chunks import PARAM
from rayshard.plans.checkpoint.model_check import check_against_own_model
from rayshard.plans.checkpoint.safetensors_layout import Entry
from rayshard.plans.errors import CheckpointError
from rayshard.plans.interop.hf_families import export_mapping
from rayshard.plans.interop.peft_adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, lora_target_list,
                                                  merged_weight_names, peft_mapping, refuse_unexportable)
from rayshard.plans.transforms.mapping import Meta
from rayshard.storage.manifest_io import read_manifest

ONE_FILE = float("inf")  # PEFT reads a single adapter_model.safetensors, never shards


def adapter_settings(metadata: dict, checkpoint_url: str, asked: str) -> dict:
    """The LoRA settings a checkpoint's manifest records; a checkpoint without adapters refused."""
    lora = metadata.get("lora")
    if not lora:
        raise CheckpointError(f"{checkpoint_url}: holds no LoRA adapters (it is not a LoRA run's checkpoint), so {asked} "
                              "has nothing to export. Fix: export a checkpoint of a run trained with --lora-rank, or this "
                              "one with --format hf (without --merge)")
    return lora


def _weights(stored) -> dict[str, Meta]:
    return {name: Meta(chunks[0].global_shape, chunks[0].dtype) for (name, kind), chunks in stored.tensors().items()
            if kind == PARAM}


def _whole(stored, metas: dict[str, Meta]):
    return lambda name: stored.read_region(name, PARAM, (0,) * len(metas[name].shape), metas[name].shape)


def export_peft(checkpoint_url: str, directory: str, dtype: str | None = None, log=print, progress=None) -> ExportResult:
    """progress: a bar (cluster/progress.py) advanced by the bytes of each tensor written."""
    started = time.perf_counter()
    fs, base = empty_export_directory(directory)
    stored = open_source(checkpoint_url)
    lora = adapter_settings(stored.metadata, checkpoint_url, "--format peft")
    model = check_against_own_model(stored.chunks, stored.metadata, checkpoint_url)
    if model.user is None:  # a user's model: by its plan's hf_mapping, refused per module there
        refuse_unexportable(model, checkpoint_url, "export the merged model with --format hf --merge")
    metas = _weights(stored)
    stored_dtype = next(iter(metas.values())).dtype
    plan = peft_mapping(lora_target_list(lora), dtype, stored_dtype, model).plan(metas)
    set_total(progress, sum(Entry(name, meta.dtype, meta.shape).nbytes for name, meta in plan.outputs.items()))
    recorded_base = stored.metadata.get("lora_base") or {}
    with published_when_done(fs, base, directory) as staging:
        written = write_safetensors_files(fs, staging, ADAPTER_WEIGHTS, plan.outputs,
                                           GroupStream(plan, _whole(stored, metas)), ONE_FILE, progress)
        stored.check_partial_reads()
        fs.pipe_file(f"{staging}/{ADAPTER_CONFIG}", json.dumps(
            adapter_config(lora, _base_name(recorded_base.get("url")), model), indent=2).encode())
        fs.pipe_file(f"{staging}/{RUN_METADATA}", json.dumps({"source": checkpoint_url, "step": stored.metadata.get("step"),
                                                              "lora": lora, "lora_base": recorded_base}, indent=2).encode())
    result = ExportResult(directory, written, len(plan.outputs), time.perf_counter() - started)
    log(f"exported the adapters of {checkpoint_url} to {directory} (PEFT): {len(plan.outputs)} tensors in "
        f"{result.seconds:.1f}s")
    return result


def _base_name(base_url: str | None) -> str | None:
    """adapter_config.json's base_model_name_or_path: the Hugging Face directory the base was
    imported from, where it was (PEFT's AutoPeftModel loads the base from it); else none."""
    if base_url is None:
        return None
    imported_from = read_manifest(base_url)[1].get("imported_from")
    return imported_from if isinstance(imported_from, str) else None


class MergedStream:
    """The base's Hugging Face tensors, each adapted projection's with (alpha / r) B A added in
    float32 (transposed where the weight is, a Conv1D's) and cast to `dtype` after."""

    def __init__(self, base: GroupStream, merges: dict[str, tuple[str, bool]], read_adapter, scale: float, dtype: str):
        self.base, self.merges, self.read_adapter, self.scale = base, merges, read_adapter, scale
        self.dtype = getattr(torch, dtype)

    def order(self) -> list[str]:
        return self.base.order()

    def take(self, name: str) -> torch.Tensor:
        weight = self.base.take(name)
        merge = self.merges.get(name)
        if merge is None:
            return weight.to(self.dtype)
        module, transposed = merge
        a, b = (self.read_adapter(f"{module}.{matrix}").to(torch.float32) for matrix in "ab")
        # PEFT's order (get_delta_weight, then add): (B @ A) * scale, added to the weight.
        delta = (b @ a) * self.scale
        return (weight.to(torch.float32) + (delta.t() if transposed else delta)).to(self.dtype)


def _refuse_unmergeable(merges: dict, outputs: dict, model, checkpoint_url: str) -> None:
    """Every adapted projection must be a tensor of the export, or its adapters would be left out
    of the merged model without a word: GPT-2's Conv1D c_attn and Phi-3's qkv_proj / gate_up_proj
    fuse the projections the adapters sit on, and the merge adds a delta per projection."""
    missing = sorted(name for name in merges if name not in outputs)
    if missing:
        raise CheckpointError(f"{checkpoint_url}: --merge cannot merge this {model.family} model's adapters: its Hugging "
                              f"Face export fuses the projections they adapt ({missing[0]} is no tensor of it"
                              f"{f', nor are {len(missing) - 1} more' if len(missing) > 1 else ''}). Fix: train on a "
                              "Llama-like family (llama, qwen2, qwen3, mistral, mixtral, qwen2_moe, qwen3_moe, gemma) to "
                              "export merged weights; this run resumes and reshards as it is")


def export_merged(checkpoint_url: str, directory: str, dtype: str | None = None,
                  max_shard_bytes: int = DEFAULT_SHARD_BYTES, log=print, progress=None) -> ExportResult:
    """progress: a bar advanced by the bytes of each tensor written (the digest check's read of
    the base is not counted)."""
    started = time.perf_counter()
    fs, base = empty_export_directory(directory)
    adapters = open_source(checkpoint_url)
    lora = adapter_settings(adapters.metadata, checkpoint_url, "--merge")
    model = check_against_own_model(adapters.chunks, adapters.metadata, checkpoint_url)
    recorded = adapters.metadata.get("lora_base") or {}
    base_url = recorded.get("url")
    if base_url is None:
        raise CheckpointError(f"{checkpoint_url}: its adapters were trained on the seeded initial weights, which no "
                              "checkpoint holds, so there is nothing to merge them into. Fix: export the adapters with "
                              "--format peft, or train them on a base checkpoint (--lora-base)")
    digest = weights_digest(base_url)
    if digest != recorded.get("digest"):
        raise CheckpointError(f"{checkpoint_url}: its base {base_url} has digest {digest[:19]}... now, but the adapters "
                              f"were trained on weights with digest {str(recorded.get('digest'))[:19]}...; merged they would "
                              "be another model. Fix: restore the base the adapters name, or export them with --format peft")
    stored = open_source(base_url)
    check_against_own_model(stored.chunks, stored.metadata, base_url)
    metas = _weights(stored)
    stored_dtype = next(iter(metas.values())).dtype
    out_dtype = dtype or stored_dtype
    plan = export_mapping(model, None, source_dtype=stored_dtype).plan(metas)  # no cast: merged in float32 first
    outputs = {name: Meta(meta.shape, out_dtype) for name, meta in plan.outputs.items()}
    merges = merged_weight_names(model, lora_target_list(lora))
    _refuse_unmergeable(merges, outputs, model, checkpoint_url)
    adapter_metas = _weights(adapters)
    stream = MergedStream(GroupStream(plan, _whole(stored, metas)), merges, _whole(adapters, adapter_metas),
                          float(lora["alpha"]) / int(lora["rank"]), out_dtype)
    set_total(progress, sum(Entry(name, meta.dtype, meta.shape).nbytes for name, meta in outputs.items()))
    # A new model: imported back it starts at step 0 with fresh moments, and says what it was merged from.
    merged_from = {"adapters": checkpoint_url, "step": adapters.metadata.get("step"), "lora": lora, "base": recorded}
    with published_when_done(fs, base, directory) as staging:
        written = write_safetensors_files(fs, staging, WEIGHTS, outputs, stream, max_shard_bytes, progress)
        stored.check_partial_reads()
        adapters.check_partial_reads()
        written += write_model_files(fs, staging, staged_url(staging, base, directory), model, stored.metadata, out_dtype, log)
        fs.pipe_file(f"{staging}/{RUN_METADATA}", json.dumps({"source": checkpoint_url, "metadata": {"merged_lora": merged_from},
                                                              "weights_dtype": out_dtype}, indent=2).encode())
    result = ExportResult(directory, written, len(outputs), time.perf_counter() - started)
    log(f"exported {checkpoint_url} merged into its base {base_url} to {directory}: {len(written)} safetensors file(s) "
        f"in {result.seconds:.1f}s")
    return result
