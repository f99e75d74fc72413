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
under `model.layers.N.self_attn` / `.mlp` (Llama, Qwen2, Qwen3, Mistral). Phi-3 fuses q/k/v and
gate/up in the Hub too (one PEFT adapter would span three of ours) and GPT-2 uses Conv1D; both are
refused naming `--merge` as the way out.

Settings: PEFT scales B A by lora_alpha / r (ours: alpha / rank); `use_rslora` (alpha / sqrt(r)),
`rank_pattern` / `alpha_pattern` (per-module ranks), DoRA, biases, `layers_to_transform` and
`modules_to_save` compute something our adapters do not, and are refused at import naming the key.

Pure: names, shapes and JSON-ready dicts; the files are read and written in `cluster/checkpoint`.
"""
from __future__ import annotations

import re

from rayshard.plans.errors import CheckpointError
from rayshard.plans.training.lora import LORA_TARGETS, adapter_module
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.plans.transforms.mapping import Cast, Mapping, Rename

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
# A PEFT key of one adapter matrix: prefix, layer, module, A or B.
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight\Z")


def refuse_unexportable(model: ModelConfig, what: str, fix: str) -> None:
    """The families whose Hugging Face modules match our adapters one to one."""
    if model.user is not None or model.family not in PEFT_FAMILIES:
        name = model.user.factory if model.user is not None else model.family
        raise CheckpointError(f"{what}: a PEFT adapter of a {name} model is not supported (PEFT's modules of that class do "
                              f"not match rayshard's per-projection adapters; supported: {', '.join(PEFT_FAMILIES)}). "
                              f"Fix: {fix}")


def ordered_targets(targets) -> tuple[str, ...]:
    """Targets in the model's module order (q, k, v, o, gate, up, down), whatever order they came in."""
    chosen = set(targets)
    return tuple(t for t in LORA_TARGETS if t in chosen)


def peft_key(layer: int | str, target: str, matrix: str) -> str:
    """PEFT's key of an adapter matrix ("a" or "b")."""
    return f"{PEFT_PREFIX}model.layers.{layer}.{HF_MODULES[target]}.lora_{matrix.upper()}.weight"


def peft_mapping(targets, dtype: str | None = None, source_dtype: str = "float32") -> Mapping:
    """Our adapter names -> PEFT's keys (cast to `dtype` if given); its inverse is the import's."""
    rules = [Rename(f"{adapter_module('{layer}', target)}.{matrix}", peft_key("{layer}", target, matrix))
             for target in ordered_targets(targets) for matrix in "ab"]
    if dtype and dtype != source_dtype:
        rules.append(Cast("*", to=dtype, source=source_dtype))
    return Mapping(tuple(rules))


def merged_weight_names(model: ModelConfig, targets) -> dict[str, str]:
    """The Hugging Face export's weight of each adapted projection -> the adapter module merged
    into it (`model.layers.0.self_attn.q_proj.weight` -> `layers.0.attention.lora.q`)."""
    return {f"model.layers.{layer}.{HF_MODULES[target]}.weight": adapter_module(layer, target)
            for layer in range(model.n_layers) for target in ordered_targets(targets)}


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else float(value)


def adapter_config(lora: dict, base_model_name_or_path: str | None) -> dict:
    """adapter_config.json for the run's LoRA settings (`lora` as the manifest records them)."""
    targets = ordered_targets(t.strip() for t in str(lora["targets"]).split(","))
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": int(lora["rank"]), "lora_alpha": _number(lora["alpha"]), "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": [HF_MODULES[t].rsplit(".", 1)[1] for t in targets],
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "init_lora_weights": True,
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
        if (found is None or int(found.group(1)) >= model.n_layers
                or f"{found.group(2)}.{found.group(3)}" not in HF_MODULES.values()):
            unknown.append(key)
    if unknown:
        raise CheckpointError(f"{where}: holds {len(unknown)} tensor(s) that are no LoRA A or B of a q/k/v/o/gate/up/down "
                              f"projection of layers 0..{model.n_layers - 1} under PEFT's prefix {PEFT_PREFIX!r}: "
                              f"{', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}. Fix: import an adapter "
                              "saved by PeftModel.save_pretrained for this base")

