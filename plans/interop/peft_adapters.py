"""PEFT's LoRA format: our adapter names <-> PEFT's keys, and our LoRA settings <-> adapter_config.json.

A rayshard adapter is per logical projection (`plans/training/lora.py`) even where the base fuses
q/k/v and gate/up, and B's rows are in the projection's own output order (q's in plain head order,
gate's and up's in hidden-unit order): exactly the rows of the Hugging Face export's separate
`q_proj`, ..., `up_proj` (`hf_families.hf_mapping` splits the fused tensors into them). So each
adapter tensor is one Rename: `layers.N.attention.lora.q.a` is PEFT's
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` ([r, in]), `.b` its `lora_B`
([out, r]). The `base_model.model.` prefix is what `PeftModel.from_pretrained` looks for: keys
without it load as nothing and the model computes the base alone (the peers' silent bug).

Families: those whose Hugging Face class has separate q/k/v/o and gate/up/down Linear modules
under `model.layers.N.self_attn` / `.mlp` (Llama, Qwen2, Qwen3, Mistral), and the mixture-of-experts
ones (Qwen2-MoE, Qwen3-MoE, Mixtral; decision 169): attention as the dense ones, a dense layer's
gate/up/down under `mlp`, an MoE layer's shared expert's under `mlp.shared_expert` (routed experts
take no adapters, decision 140). Their `target_modules` then name the parent too
(`mlp.gate_proj`, `shared_expert.gate_proj`), so PEFT, which matches a name against the end of a
module's path, adapts exactly our modules and never a routed expert's `experts.E.gate_proj`.
Phi-3 fuses q/k/v and gate/up in the Hub too (one PEFT adapter would span three of ours) and the
GPT-2 family fuses q|k|v; both are refused naming `--merge` as the way out (the merge adds each
adapter's delta before the fusion, `merged_weight_names`).

Users' models (`--model-factory`): an adapter beside module M is PEFT's adapter on the module the
plan's `hf_mapping` makes of M's weight, where that mapping only renames it (and perhaps
transposes it: a Conv1D, whose PEFT adapter has the same A [r, in] and B [out, r]); a weight the
mapping fuses or splits has no PEFT module of its own and is refused naming it
(`user_peft_modules`).

Settings: PEFT scales B A by lora_alpha / r (ours: alpha / rank); `use_rslora` (alpha / sqrt(r)),
`rank_pattern` / `alpha_pattern` (per-module ranks), DoRA, biases, `layers_to_transform` and
`modules_to_save` compute something our adapters do not, and are refused at import naming the key.

Pure: names, shapes and JSON-ready dicts; the files are read and written in `cluster/checkpoint`.
"""
from __future__ import annotations

import re

from rayshard.plans.errors import CheckpointError
from rayshard.plans.interop.hf_families import refuse_unexportable_moe
from rayshard.plans.interop.hf_gpt2 import gpt2_projection_weights
from rayshard.plans.training.lora import (ATTENTION_TARGETS, LORA_TARGETS, adapter_module, feed_forward_path,
                                          user_adapter_module, user_target_modules)
from rayshard.plans.training.model_spec import MOE_FAMILIES, ModelConfig
from rayshard.plans.transforms.codec import decode_mapping
from rayshard.plans.transforms.mapping import Cast, Mapping, Meta, Rename, Transpose

PEFT_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
ADAPTER_WEIGHTS = "adapter_model"  # .safetensors
ADAPTER_CONFIG = "adapter_config.json"
# What PeftModel.save_pretrained writes with safe_serialization=False: a pickle, never read here.
PICKLED_WEIGHTS = "adapter_model.bin"
PEFT_PREFIX = "base_model.model."
# Each logical projection's module in the Hugging Face class, under model.layers.N.
HF_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
TARGET_OF_MODULE = {module.rsplit(".", 1)[1]: target for target, module in HF_MODULES.items()}  # "q_proj" -> "q"
# Where a layer's gate/up/down adapters live (`lora.feed_forward_path`) -> their modules' parent in
# the Hugging Face class: a dense feed-forward's `mlp`, an MoE layer's shared expert.
HF_FEED_FORWARD = {"feed_forward": "mlp", "feed_forward.shared": "mlp.shared_expert"}
# A PEFT key of one adapter matrix: prefix, layer, module, A or B.
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|mlp(?:\.shared_expert)?)\.\w+)"
                  r"\.lora_([AB])\.weight\Z")
_KNOWN_MODULES = {*HF_MODULES.values(), *(f"{HF_FEED_FORWARD['feed_forward.shared']}.{t}_proj" for t in ("gate", "up", "down"))}


def refuse_unexportable(model: ModelConfig, what: str, fix: str) -> None:
    """The families whose Hugging Face modules match our adapters one to one (an MoE family's
    model as its transformers class computes it, `refuse_unexportable_moe`)."""
    if model.user is not None or model.family not in (*PEFT_FAMILIES, *MOE_FAMILIES):
        name = model.user.factory if model.user is not None else model.family
        raise CheckpointError(f"{what}: a PEFT adapter of a {name} model is not supported (PEFT's modules of that class do "
                              f"not match rayshard's per-projection adapters; supported: "
                              f"{', '.join((*PEFT_FAMILIES, *MOE_FAMILIES))}). Fix: {fix}")
    if model.family in MOE_FAMILIES:
        refuse_unexportable_moe(model)


def ordered_targets(targets) -> tuple[str, ...]:
    """Targets in the model's module order (q, k, v, o, gate, up, down), whatever order they came in."""
    chosen = set(targets)
    return tuple(t for t in LORA_TARGETS if t in chosen)


def _hf_module(target: str, part: str | None = None) -> str:
    """The Hugging Face module (under model.layers.N) of a target; `part`: where a feed-forward
    target's adapter lives in that layer (`lora.feed_forward_path`)."""
    if target in ATTENTION_TARGETS:
        return HF_MODULES[target]
    return f"{HF_FEED_FORWARD[part or 'feed_forward']}.{target}_proj"


def _parts(target: str) -> tuple[str, ...]:
    return ("attention",) if target in ATTENTION_TARGETS else tuple(HF_FEED_FORWARD)


def peft_mapping(targets, dtype: str | None = None, source_dtype: str = "float32", model: ModelConfig | None = None) -> Mapping:
    """Our adapter names -> PEFT's keys (cast to `dtype` if given); its inverse is the import's.
    A user's model (`model.user`) maps by its plan's hf_mapping (`user_peft_modules`)."""
    if model is not None and model.user is not None:
        rules = [Rename(f"{user_adapter_module(module)}.{matrix}", f"{PEFT_PREFIX}{hf_module}.lora_{matrix.upper()}.weight")
                 for module, (hf_module, _) in user_peft_modules(model, targets).items() for matrix in "ab"]
    else:
        rules = [Rename(f"layers.{{layer}}.{part}.lora.{target}.{matrix}",
                        f"{PEFT_PREFIX}model.layers.{{layer}}.{_hf_module(target, part)}.lora_{matrix.upper()}.weight")
                 for target in ordered_targets(targets) for part in _parts(target) for matrix in "ab"]
    if dtype and dtype != source_dtype:
        rules.append(Cast("*", to=dtype, source=source_dtype))
    return Mapping(tuple(rules))


def merged_weight_names(model: ModelConfig, targets) -> dict[str, str]:
    """Where the merged export adds each adapter's delta -> the adapter module: the name, in the
    export mapping of the model's family, under which the adapted projection's weight first stands
    alone as [out, in] (`transform_exec.run_group` adjusts each name once, where it first appears).
    Llama-like families: the Hugging Face export's own q_proj ... down_proj (an MoE layer's
    gate/up/down its shared expert's), which Phi-3's export then fuses into qkv_proj and
    gate_up_proj; GPT-2: q, k and v between their split and c_attn (`gpt2_projection_weights`);
    a user's model: its own weight, before its plan's hf_mapping renames, transposes or fuses it."""
    if model.user is not None:
        return {f"{module}.weight": user_adapter_module(module) for module in user_target_modules(model, targets)}
    if model.family == "gpt2":
        return {gpt2_projection_weights(layer)[target]: adapter_module(layer, target, model)
                for layer in range(model.n_layers) for target in ordered_targets(targets) if target in ATTENTION_TARGETS}
    return {f"model.layers.{layer}.{_hf_module(target, feed_forward_path(model, layer))}.weight":
            adapter_module(layer, target, model)
            for layer in range(model.n_layers) for target in ordered_targets(targets)
            if target in ATTENTION_TARGETS or feed_forward_path(model, layer) is not None}


def user_peft_modules(model: ModelConfig, targets) -> dict[str, tuple[str, bool]]:
    """A user model's adapted module -> (the Hugging Face module its plan's hf_mapping makes of
    its weight, whether transposed). Refused in one line: a plan without hf_mapping, and a weight
    the mapping does more to than rename and transpose (fused with others, split)."""
    plan = model.user.plan
    if plan.hf_mapping is None:
        raise CheckpointError(f"{model.user.factory}: its plan has no hf_mapping, so its adapters have no Hugging Face "
                              "module to sit on. Fix: add hf_mapping and hf_config to the model plan")
    shapes = {name: Meta(tuple(shape), "float32") for name, shape in model.user.shapes.items()}
    steps = [step for group in decode_mapping(plan.hf_mapping).plan(shapes).groups for step in group.steps]
    found = {}
    for module in user_target_modules(model, targets):
        name, transposed = f"{module}.weight", False
        for step in steps:
            if name not in step.inputs:
                continue
            if isinstance(step.rule, Transpose):
                transposed = not transposed
            elif not isinstance(step.rule, (Rename, Cast)) or len(step.outputs) != 1:
                raise CheckpointError(f"{model.user.factory}: the plan's hf_mapping makes {module}.weight part of "
                                      f"{', '.join(step.outputs)} ({type(step.rule).__name__}), so its adapter has no "
                                      f"PEFT module of its own. Fix: leave {module} out of --lora-targets, or export the "
                                      "merged model with --format hf --merge")
            name = step.outputs[0]
        if not name.endswith(".weight"):
            raise CheckpointError(f"{model.user.factory}: the plan's hf_mapping names {module}.weight {name}, which is no "
                                  "module's weight. Fix: export the merged model with --format hf --merge")
        found[module] = (name[: -len(".weight")], transposed)
    return found


def target_module_names(model: ModelConfig, targets) -> list[str]:
    """adapter_config.json's target_modules: the projections' module names (`q_proj`); on an
    MoE family a feed-forward target names its parent too (`mlp.gate_proj`,
    `shared_expert.gate_proj`), so PEFT adapts no routed expert; a user's model lists the
    Hugging Face modules themselves."""
    if model.user is not None:
        return [hf_module for hf_module, _ in user_peft_modules(model, targets).values()]
    names = []
    for target in ordered_targets(targets):
        if target in ATTENTION_TARGETS or model.family not in MOE_FAMILIES:
            names.append(HF_MODULES[target].rsplit(".", 1)[1])
            continue
        parts = dict.fromkeys(feed_forward_path(model, layer) for layer in range(model.n_layers))
        names += [_hf_module(target, part).split(".", 1)[1] if part == "feed_forward.shared" else _hf_module(target, part)
                  for part in HF_FEED_FORWARD if part in parts]
    return names


def lora_target_list(lora: dict) -> tuple[str, ...]:
    """The targets a manifest's `lora` record names, as given (a user model's may be patterns)."""
    return tuple(t.strip() for t in str(lora["targets"]).split(",") if t.strip())


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def adapter_config(lora: dict, base_model_name_or_path: str | None, model: ModelConfig) -> dict:
    """adapter_config.json for the run's LoRA settings (`lora` as the manifest records them).
    fan_in_fan_out: the adapted modules are Conv1D (a user model's mapping transposes them), as
    PEFT itself saves it for such a model."""
    targets = lora_target_list(lora)
    transposed = model.user is not None and any(t for _, t in user_peft_modules(model, targets).values())
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": int(lora["rank"]), "lora_alpha": _number(lora["alpha"]), "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": target_module_names(model, targets),
        "bias": "none", "fan_in_fan_out": transposed, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }


# adapter_config.json keys whose other values compute something our adapters do not: key -> values
# that are fine (PEFT's defaults).
_FINE = {
    "use_rslora": (False, None), "use_dora": (False, None), "bias": ("none", None), "fan_in_fan_out": (False, None),
    "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "modules_to_save": (None, []),
    "layers_to_transform": (None, []), "layer_replication": (None,), "lora_bias": (False, None),
    "trainable_token_indices": (None,), "target_parameters": (None, []), "use_qalora": (False, None),
    "alora_invocation_tokens": (None,),
}
# init_lora_weights values that change the base at init (PiSSA, OLoRA, CorDA): such an adapter
# is only right on the modified base its trainer kept.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda")


def lora_settings(config: dict, where: str) -> dict:
    """Our LoRA settings {rank, alpha, dropout, targets} from an adapter_config.json, or a
    CheckpointError naming the key that asks for something else."""
    if config.get("peft_type") != "LORA":
        raise CheckpointError(f"{where}: peft_type={config.get('peft_type')!r}; rayshard imports LoRA adapters only "
                              "(peft_type 'LORA'). Fix: import a LoRA adapter directory")
    unsupported = [f"{key}={config[key]!r}" for key, fine in _FINE.items() if key in config and config[key] not in fine]
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        unsupported.append(f"init_lora_weights={init!r}")
    if unsupported:
        raise CheckpointError(f"{where}: this adapter uses {', '.join(unsupported)}, which rayshard's LoRA does not "
                              "compute; importing it would change what the adapter computes. Fix: train the adapter "
                              "without them")
    rank, alpha, dropout = config.get("r"), config.get("lora_alpha"), config.get("lora_dropout", 0.0)
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise CheckpointError(f"{where}: r={rank!r} is not a positive whole number. Fix: restore the file")
    for key, value in (("lora_alpha", alpha), ("lora_dropout", dropout)):
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CheckpointError(f"{where}: {key}={value!r} is not a number. Fix: restore the file")
    return {"rank": rank, "alpha": float(alpha), "dropout": float(dropout),
            "targets": ",".join(_targets(config.get("target_modules"), where))}


def _targets(modules, where: str) -> tuple[str, ...]:
    """target_modules as our targets: a list of module names (or one name), or "all-linear"."""
    if modules == "all-linear":  # PEFT: every Linear of the decoder layers, the output layer aside
        return LORA_TARGETS
    names = [modules] if isinstance(modules, str) else modules
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{where}: target_modules={modules!r} is not a list of module names. Fix: list the "
                              f"modules, e.g. {sorted(TARGET_OF_MODULE)}")
    # PEFT matches a listed name against the end of a module's dotted path.
    unknown = sorted(n for n in names if n.rsplit(".", 1)[-1] not in TARGET_OF_MODULE)
    if unknown:
        raise CheckpointError(f"{where}: target_modules names {unknown}, which are no projection rayshard adapts; the "
                              f"modules it adapts are {', '.join(TARGET_OF_MODULE)}. Fix: train the adapter on those only")
    return ordered_targets(TARGET_OF_MODULE[n.rsplit(".", 1)[-1]] for n in names)


def refuse_unknown_keys(keys, model: ModelConfig, where: str) -> None:
    """Every key must be an A or B of a projection of one of the base's layers, with PEFT's prefix:
    a key without it is one PEFT itself would ignore."""
    unknown = []
    for key in sorted(keys):
        found = _KEY.match(key)
        if found is None or int(found.group(1)) >= model.n_layers or found.group(2) not in _KNOWN_MODULES:
            unknown.append(key)
    if unknown:
        raise CheckpointError(f"{where}: holds {len(unknown)} tensor(s) that are no LoRA A or B of a q/k/v/o/gate/up/down "
                              f"projection of layers 0..{model.n_layers - 1} under PEFT's prefix {PEFT_PREFIX!r}: "
                              f"{', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}. Fix: import an adapter "
                              "saved by PeftModel.save_pretrained for this base")

