"""Hugging Face model families: our parameter names <-> theirs, and our ModelConfig <-> config.json.

One decoder (`plans/training/model_spec.py`) expresses four families; each differs from Llama by
what transformers' class computes:

- llama (`LlamaForCausalLM`): the base.
- qwen2 (`Qwen2ForCausalLM`): q, k and v projections carry biases (always, in transformers).
- qwen3 (`Qwen3ForCausalLM`): no biases; q and k are RMS-normalised per head before RoPE; the head
  size is explicit (`head_dim`, not hidden_size / num_attention_heads).
- mistral (`MistralForCausalLM`): sliding-window attention where `sliding_window` is set.

A config.json that asks for something this decoder does not compute (rope scaling, an unknown
`model_type`, attention bias where the family has none, a per-layer sliding window) is refused
naming the field: importing it would change what the weights compute.

The mapping is written once, in the export direction; import uses its derived inverse.
A user's model (`--model-factory`) brings its own mapping and config.json in its plan
(`ModelPlan.hf_mapping` / `hf_config`); `export_mapping` and `export_config` pick either.
"""
from __future__ import annotations

from plans.checkpoint.transform_codec import decode_mapping
from plans.checkpoint.transforms import Alias, Cast, Mapping, Rename, SplitRows
from plans.errors import CheckpointError, ConfigError
from plans.training.model_spec import ModelConfig

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM"}


def hf_mapping(model: ModelConfig, dtype: str | None = None) -> Mapping:
    """Our parameter names -> transformers' names for the model's family (cast to `dtype` if given).

    qkv rows are grouped per kv head g: [q heads g*r .. g*r+r-1, k_g, v_g] (r query heads per kv
    head), so the split takes n_kv_heads groups of (r*head_dim, head_dim, head_dim) rows and
    q_proj comes out in plain head order; Qwen2's biases split the same way. gate_up interleaves
    (gate_j, up_j) per hidden unit: ffn_dim groups of (1, 1) rows. RoPE already uses the
    rotate-half convention transformers uses, so q and k rows need no permutation.
    """
    layer = "layers.{layer}."
    hf_layer = "model.layers.{layer}."
    qkv_rows = (model.heads_per_group * model.head_dim, model.head_dim, model.head_dim)
    rules = [
        Rename("tok_embeddings.weight", "model.embed_tokens.weight"),
        Rename(layer + "attention_norm.weight", hf_layer + "input_layernorm.weight"),
        SplitRows(layer + "attention.qkv.weight", tuple(hf_layer + f"self_attn.{p}_proj.weight" for p in "qkv"),
                  qkv_rows, model.n_kv_heads),
        Rename(layer + "attention.wo.weight", hf_layer + "self_attn.o_proj.weight"),
        Rename(layer + "ffn_norm.weight", hf_layer + "post_attention_layernorm.weight"),
        SplitRows(layer + "feed_forward.gate_up.weight",
                  (hf_layer + "mlp.gate_proj.weight", hf_layer + "mlp.up_proj.weight"), (1, 1), model.ffn_dim),
        Rename(layer + "feed_forward.down.weight", hf_layer + "mlp.down_proj.weight"),
        Rename("norm.weight", "model.norm.weight"),
    ]
    if model.qkv_bias:
        rules.append(SplitRows(layer + "attention.qkv.bias", tuple(hf_layer + f"self_attn.{p}_proj.bias" for p in "qkv"),
                               qkv_rows, model.n_kv_heads))
    if model.qk_norm:
        rules += [Rename(layer + "attention.q_norm.weight", hf_layer + "self_attn.q_norm.weight"),
                  Rename(layer + "attention.k_norm.weight", hf_layer + "self_attn.k_norm.weight")]
    if model.tie_embeddings:
        rules.append(Alias("lm_head.weight", of="model.embed_tokens.weight"))
    else:
        rules.append(Rename("output.weight", "lm_head.weight"))
    if dtype and dtype != "float32":
        rules.append(Cast("*", to=dtype, source="float32"))
    return Mapping(tuple(rules))


def export_mapping(model: ModelConfig, dtype: str | None = None, source_dtype: str = "float32") -> Mapping:
    """The export mapping of a built-in family or of a user's plan (cast to `dtype` if given)."""
    if model.user is None:
        return hf_mapping(model, dtype)
    mapping = decode_mapping(_user_plan_for_export(model).hf_mapping)
    if dtype and dtype != source_dtype:
        mapping = Mapping(mapping.rules + (Cast("*", to=dtype, source=source_dtype),))
    return mapping


def export_config(model: ModelConfig, dtype: str) -> dict:
    """config.json: a family's, or the user plan's with the weights' dtype set as `hf_config` sets it."""
    if model.user is None:
        return hf_config(model, dtype)
    return {**_user_plan_for_export(model).hf_config, "torch_dtype": dtype, "dtype": dtype}


def _user_plan_for_export(model: ModelConfig):
    plan = model.user.plan
    if plan.hf_mapping is None:
        raise ConfigError("checkpoint model", model.user.factory, "is a user model whose plan has no Hugging Face mapping",
                          "give its ModelPlan hf_mapping (rules as data, plans/checkpoint/transform_codec.py) and "
                          "hf_config (config.json contents), as examples/gpt2/model.py does, and train or resume with it")
    return plan


def hf_config(model: ModelConfig, dtype: str) -> dict:
    """config.json for the model's family."""
    config = {
        "architectures": [ARCHITECTURES[model.family]], "model_type": model.family,
        "vocab_size": model.vocab_size, "hidden_size": model.dim, "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads, "head_dim": model.head_dim,
        "max_position_embeddings": model.max_seq_len, "rms_norm_eps": model.norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta.
        "rope_theta": model.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "tie_word_embeddings": model.tie_embeddings, "hidden_act": "silu", "torch_dtype": dtype, "dtype": dtype,
    }
    if model.family in ("llama", "qwen3"):
        config["attention_bias"] = False
    if model.family == "llama":
        config["mlp_bias"] = False
    if model.family in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None)
    if model.family == "mistral":
        config["sliding_window"] = model.sliding_window
    return config


def model_config_from_hf(config: dict, where: str) -> ModelConfig:
    """Our ModelConfig from a config.json of a family we compute; refuses what we would approximate."""
    family = config.get("model_type")
    if family not in ARCHITECTURES:
        raise CheckpointError(f"{where}: model_type {family!r} is not one rayshard computes; supported: "
                              f"{', '.join(sorted(ARCHITECTURES))}")
    unsupported = [f"{key}={config[key]!r}" for key, fine in _EXPECTED[family] if key in config and config[key] != fine]
    # transformers 5 writes rope_parameters, 4.x rope_scaling; a file edited by hand may hold both.
    for key in ("rope_parameters", "rope_scaling"):
        rope_type = (config.get(key) or {}).get("rope_type", (config.get(key) or {}).get("type", "default"))
        if rope_type not in ("default", None):
            unsupported.append(f"{key}.rope_type={rope_type!r}")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if family in ("qwen2", "qwen3") and config.get("use_sliding_window"):
        unsupported.append(f"use_sliding_window={config['use_sliding_window']!r}")
    layer_types = set(config.get("layer_types") or ())
    if layer_types - {"full_attention", "sliding_attention"} or (family != "mistral" and "sliding_attention" in layer_types):
        unsupported.append(f"layer_types={sorted(layer_types)!r}")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    if family == "qwen2" and head_dim != config["hidden_size"] // heads:  # Qwen2's class ignores head_dim
        unsupported.append(f"head_dim={head_dim} (Qwen2 computes hidden_size / num_attention_heads)")
    if unsupported:
        raise CheckpointError(f"{where}: this {family} model uses {', '.join(unsupported)}, which rayshard does not "
                              "implement; importing it would change what the weights compute")
    sliding_window = config.get("sliding_window") if family == "mistral" else None
    return ModelConfig(
        vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads, ffn_dim=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 2048),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        norm_eps=float(config.get("rms_norm_eps", 1e-5)), tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        family=family, qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
        sliding_window=int(sliding_window) if sliding_window else None,
        head_size=head_dim if head_dim != config["hidden_size"] // heads else None,
    ).validate()


# config.json keys whose other values change what the family's class computes.
_EXPECTED = {
    "llama": (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)),
    "qwen2": (("hidden_act", "silu"),),
    "qwen3": (("hidden_act", "silu"), ("attention_bias", False)),
    "mistral": (("hidden_act", "silu"),),
}
