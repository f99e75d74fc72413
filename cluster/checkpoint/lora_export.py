"""A LoRA run's checkpoint out of rayshard: the adapters as a PEFT directory, or the model merged.

- `export_peft`: `adapter_model.safetensors` (PEFT's keys, `plans/interop/peft_adapters.py`) and
  `adapter_config.json` (r, lora_alpha, lora_dropout, target_modules: the run's), which
  `PeftModel.from_pretrained(base, DIR)` loads onto the Hugging Face export of the base or the
  directory the base was imported from. `rayshard.json` beside them names the checkpoint and its
  base (URL and weight digest), so an import of the directory can check the base it is given.
  MoE families and users' models map as `plans/interop/peft_adapters.py` says (decision 169).
- `export_merged`: the Hugging Face directory of the base (`hf_interop.py`'s mapping, config.json,
  tokenizer) with each adapted projection's weight replaced by W + (alpha / r) B A, computed in
  float32 from the stored values and only then cast to the export dtype; where the family's export
  fuses projections (Phi-3's qkv_proj and gate_up_proj, GPT-2's c_attn), each is merged before
  the fusion (`LoraMerge`). The base is the one the
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


class LoraMerge:
    """The merged export's `Adjust` (`transform_exec.run_group`): where an adapted projection's
    weight first stands alone ([out, in], `merged_weight_names`), (alpha / r) B A is added in
    float32, in PEFT's order (get_delta_weight, then add); a fused export concatenates after."""

    def __init__(self, merges: dict[str, str], read_adapter, scale: float):
        self.merges, self.read_adapter, self.scale = merges, read_adapter, scale
        self.merged: set[str] = set()

    def __call__(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        module = self.merges.get(name)
        if module is None:
            return tensor
        a, b = (self.read_adapter(f"{module}.{matrix}").to(torch.float32) for matrix in "ab")
        self.merged.add(name)
        return tensor.to(torch.float32) + (b @ a) * self.scale


class _CastStream:
    """A stream's tensors cast to the export dtype: after the merge, never before it."""

    def __init__(self, base: GroupStream, dtype: str):
        self.base, self.dtype = base, getattr(torch, dtype)

    def order(self) -> list[str]:
        return self.base.order()

    def take(self, name: str) -> torch.Tensor:
        return self.base.take(name).to(self.dtype)


def _refuse_unmerged(merges: dict[str, str], plan, adapter_names, checkpoint_url: str) -> set[str]:
    """Every adapter the checkpoint holds has a place in the export (a source or a step's output
    named as `merged_weight_names` says), or it would be left out of the merged model without a
    word; checked before anything is written. Returns the names the merge will adjust."""
    appearing = {name for group in plan.groups for name in (*group.sources, *(o for step in group.steps for o in step.outputs))}
    placed = {module for name, module in merges.items() if name in appearing}
    held = sorted({name.rsplit(".", 1)[0] for name in adapter_names} - placed)
    if held:
        raise CheckpointError(f"{checkpoint_url}: --merge has no weight of the export to merge the adapter {held[0]} into"
                              f"{f' (nor {len(held) - 1} more)' if len(held) > 1 else ''}. Fix: export the adapters with "
                              "--format peft; this run resumes and reshards as it is")
    return {name for name in merges if name in appearing}


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
    adapter_metas = _weights(adapters)
    placed = _refuse_unmerged(merges, plan, adapter_metas, checkpoint_url)
    merge = LoraMerge(merges, _whole(adapters, adapter_metas), float(lora["alpha"]) / int(lora["rank"]))
    stream = _CastStream(GroupStream(plan, _whole(stored, metas), merge), out_dtype)
    set_total(progress, sum(Entry(name, meta.dtype, meta.shape).nbytes for name, meta in outputs.items()))
    # A new model: imported back it starts at step 0 with fresh moments, and says what it was merged from.
    merged_from = {"adapters": checkpoint_url, "step": adapters.metadata.get("step"), "lora": lora, "base": recorded}
    with published_when_done(fs, base, directory) as staging:
        written = write_safetensors_files(fs, staging, WEIGHTS, outputs, stream, max_shard_bytes, progress)
        if merge.merged != placed:  # every group ran: a name not adjusted is a bug, never a model to publish
            raise CheckpointError(f"{checkpoint_url}: --merge left out the adapters of {sorted(placed - merge.merged)[0]}; "
                                  "nothing was published")
        stored.check_partial_reads()
        adapters.check_partial_reads()
        written += write_model_files(fs, staging, staged_url(staging, base, directory), model, stored.metadata, out_dtype, log)
        fs.pipe_file(f"{staging}/{RUN_METADATA}", json.dumps({"source": checkpoint_url, "metadata": {"merged_lora": merged_from},
                                                              "weights_dtype": out_dtype}, indent=2).encode())
    result = ExportResult(directory, written, len(outputs), time.perf_counter() - started)
    log(f"exported {checkpoint_url} merged into its base {base_url} to {directory}: {len(written)} safetensors file(s) "
        f"in {result.seconds:.1f}s")
    return result
