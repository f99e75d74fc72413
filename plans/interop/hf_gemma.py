"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`, model_type
`gemma3_text`) as families of the one decoder: their config.json and tensor names.

Both are the decoder with Gemma's switches (decision 143): RMSNorms scaled by (1 + weight) in
float32, a second norm after attention and after the feed-forward (four per layer), the token
embedding times sqrt(hidden) in the embedding's dtype, a gated GELU (gelu_pytorch_tanh) in the
fused gate_up, scores scaled by query_pre_attn_scalar ** -0.5, sliding-window and full layers
alternating as `layer_types` says, and a tied head by default. Gemma 2 soft-caps the attention
scores and the final logits; Gemma 3 normalises q and k per head, and its sliding layers rotate
with their own base (`rope_local_base_freq`, no scaling) while the full layers take rope_theta and
the model's rope scaling. (transformers' Gemma3 attention never applies `attn_logit_softcapping`,
so an import sets no attention cap for gemma3, and an export of one with a cap is refused.)

The tensors are Llama's names but for the norms: our `attention_norm`, `post_attention_norm`,
`ffn_norm`, `post_ffn_norm` are `input_layernorm`, `post_attention_layernorm`,
`pre_feedforward_layernorm`, `post_feedforward_layernorm` (Llama's `post_attention_layernorm` is
the pre-feed-forward norm; Gemma's is the norm after attention). The norm weights are moved as
stored, offsets from 1, so the mapping is renames and Llama's two splits; import is its inverse.

Defaults for keys a config.json leaves out are Gemma2Config's and Gemma3TextConfig's (transformers
5.24): head_dim 256, query_pre_attn_scalar 256, sliding_window 4096, rms_norm_eps 1e-6, tied
embeddings, Gemma 2's caps 50 (attention) and 30 (logits), Gemma 3's bases 1e6 (global) and 1e4
(local) and one full layer in 6 (`sliding_window_pattern`).
"""
from __future__ import annotations

import math
import re

from rayshard.plans.errors import CheckpointError
from rayshard.plans.interop.hf_rope import rope_from_hf
from rayshard.plans.transforms.mapping import Alias, Cast, Mapping, Rename, SplitRows
from rayshard.plans.training.model_spec import ModelConfig

GEMMA_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
# config.json's model_type -> our family, and back.
GEMMA_MODEL_TYPES = {"gemma2": "gemma2", "gemma3_text": "gemma3"}
EXPORTED_MODEL_TYPE = {"gemma2": "gemma2", "gemma3": "gemma3_text"}
ACTIVATION = "gelu_pytorch_tanh"  # what transformers' Gemma classes compute by default; the only one taken
_NORMS = (("attention_norm", "input_layernorm"), ("post_attention_norm", "post_attention_layernorm"),
          ("ffn_norm", "pre_feedforward_layernorm"), ("post_ffn_norm", "post_feedforward_layernorm"))
# Gemma3ForConditionalGeneration's tensors: its text model's under `model.language_model.`
# (transformers 5; 4.x wrote `language_model.model.` and `language_model.lm_head.`), beside the
# vision tower and the projector, which the text model leaves out.
_TEXT_PART = ((re.compile(r"(model\.language_model|language_model\.model)\."), "model."),
              (re.compile(r"language_model\.lm_head\."), "lm_head."))
_VISION_PART = re.compile(r"(model\.)?(vision_tower|multi_modal_projector)\.")
_DEFAULTS = {
    "gemma2": dict(rope_theta=10000.0, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   max_position_embeddings=8192, pattern=2),
    "gemma3": dict(rope_theta=1_000_000.0, rope_local_base_freq=10000.0, attn_logit_softcapping=None,
                   final_logit_softcapping=None, max_position_embeddings=131_072, pattern=6),
}


def gemma_mapping(model: ModelConfig, dtype: str | None = None) -> Mapping:
    """Our names -> Gemma2ForCausalLM's / Gemma3ForCausalLM's (what save_pretrained writes)."""
    refuse_unexportable_gemma(model)
    layer, hf = "layers.{layer}.", "model.layers.{layer}."
    qkv_rows = (model.heads_per_group * model.head_dim, model.head_dim, model.head_dim)
    rules: list = [Rename("tok_embeddings.weight", "model.embed_tokens.weight")]
    rules += [Rename(layer + f"{ours}.weight", hf + f"{theirs}.weight") for ours, theirs in _NORMS]
    rules += [SplitRows(layer + "attention.qkv.weight", tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
                        qkv_rows, model.n_kv_heads),
              Rename(layer + "attention.wo.weight", hf + "self_attn.o_proj.weight"),
              SplitRows(layer + "feed_forward.gate_up.weight", (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                        (1, 1), model.ffn_dim),
              Rename(layer + "feed_forward.down.weight", hf + "mlp.down_proj.weight"),
              Rename("norm.weight", "model.norm.weight")]
    if model.qk_norm:
        rules += [Rename(layer + "attention.q_norm.weight", hf + "self_attn.q_norm.weight"),
                  Rename(layer + "attention.k_norm.weight", hf + "self_attn.k_norm.weight")]
    rules.append(Alias("lm_head.weight", of="model.embed_tokens.weight") if model.tie_embeddings
                 else Rename("output.weight", "lm_head.weight"))
    if dtype and dtype != "float32":
        rules.append(Cast("*", to=dtype, source="float32"))
    return Mapping(tuple(rules))


def refuse_unexportable_gemma(model: ModelConfig) -> None:
    """What the family's transformers class computes that this model does not (or the reverse)."""
    family, gemma3 = model.family, model.family == "gemma3"
    sliding_rope_differs = (gemma3 and model.rope_local_theta is None and model.rope_scaling is not None
                            and any(model.is_sliding_layer(i) for i in range(model.n_layers)))
    problems = (
        (model.norm != "rmsnorm_plus_one", f"norm={model.norm!r}", "norm rmsnorm_plus_one"),
        (model.mlp != "geglu_tanh", f"mlp={model.mlp!r}", "mlp geglu_tanh"),
        (not model.post_norms, "post_norms=False", "post_norms"),
        (not model.embedding_scale, "embedding_scale=False", "embedding_scale"),
        (model.position_embedding != "rope", f"position_embedding={model.position_embedding!r}", "rope"),
        (model.qkv_bias or model.wo_bias or model.mlp_bias, "qkv_bias/wo_bias/mlp_bias", "no biases"),
        (model.is_moe, f"n_experts={model.n_experts}", "n_experts 0"),
        (model.qk_norm != gemma3, f"qk_norm={model.qk_norm}", f"qk_norm {gemma3}"),
        (not gemma3 and model.rope_local_theta is not None, f"rope_local_theta={model.rope_local_theta}",
         "no rope_local_theta (Gemma 2 rotates every layer alike), or family gemma3"),
        (gemma3 and model.attn_softcap is not None, f"attn_softcap={model.attn_softcap}",
         "no attn_softcap (Gemma3ForCausalLM ignores attn_logit_softcapping), or family gemma2"),
        (sliding_rope_differs, "rope_local_theta=None with rope_scaling",
         "rope_local_theta set (Gemma 3's sliding layers rotate without scaling)"),
    )
    for wrong, setting, fix in problems:
        if wrong:
            raise CheckpointError(f"cannot export this {family} model: model.{setting} is not what "
                                  f"{GEMMA_ARCHITECTURES[family]} computes. Fix: train with {fix}")


def gemma_config(model: ModelConfig, dtype: str) -> dict:
    """config.json as Gemma2Config / Gemma3TextConfig read it, set to what our model computes: the
    layer types listed, RoPE in transformers 5's spelling and 4.x's, dropout 0."""
    scalar = model.query_pre_attn_scalar if model.query_pre_attn_scalar is not None else model.head_dim
    layer_types = ["sliding_attention" if model.is_sliding_layer(i) else "full_attention" for i in range(model.n_layers)]
    config = {
        "architectures": [GEMMA_ARCHITECTURES[model.family]], "model_type": EXPORTED_MODEL_TYPE[model.family],
        "vocab_size": model.vocab_size, "hidden_size": model.dim, "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads, "head_dim": model.head_dim,
        "max_position_embeddings": model.max_seq_len, "rms_norm_eps": model.norm_eps,
        "hidden_activation": ACTIVATION, "hidden_act": ACTIVATION,
        # Gemma2Config types it as an int: a whole number is written as one.
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "sliding_window": model.sliding_window, "layer_types": layer_types,
        "final_logit_softcapping": model.logit_softcap, "attn_logit_softcapping": model.attn_softcap,
        "attention_bias": False, "attention_dropout": 0.0, "use_bidirectional_attention": False,
        "tie_word_embeddings": model.tie_embeddings, "torch_dtype": dtype, "dtype": dtype,
        # Gemma's configs default pad 0, eos 1, bos 2: a model that names none says so.
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    scaling = model.rope_scaling.to_dict() if model.rope_scaling is not None else {"rope_type": "default"}
    global_rope = {**scaling, "rope_theta": model.rope_theta}
    if model.family == "gemma2":
        config.update(rope_theta=model.rope_theta, rope_parameters=global_rope)
    else:
        local_theta = model.rope_local_theta if model.rope_local_theta is not None else model.rope_theta
        config.update(rope_parameters={"full_attention": global_rope,
                                       "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
                      rope_theta=model.rope_theta, rope_local_base_freq=local_theta)  # 4.x's names
    if model.rope_scaling is not None:
        config["rope_scaling"] = model.rope_scaling.to_dict()  # 4.x's name; the same values
    if model.special_tokens is not None:
        config.update(model.special_tokens.hf_fields())
    return config


def text_config_of(config: dict, where: str) -> dict:
    """A Gemma3ForConditionalGeneration config.json's text model, as Gemma3ForCausalLM's config.json
    would say it (model_type gemma3_text; the tie and the special ids where only the outer config
    names them; no final soft-capping, which the multimodal class does not apply)."""
    text = config.get("text_config") or {}
    if not isinstance(text, dict) or text.get("model_type", "gemma3_text") != "gemma3_text":
        raise CheckpointError(f"{where}: text_config={text!r} is not a Gemma 3 text model's config. Fix: restore the file")
    inherited = {key: config[key] for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
                 if key in config and key not in text}
    # Gemma3ForConditionalGeneration's head never soft-caps (transformers 5.24), whatever its
    # text_config says; Gemma3ForCausalLM's does: the text model is imported as the whole computed it.
    return {**inherited, **text, "model_type": "gemma3_text", "final_logit_softcapping": None}


def gemma3_text_name(name: str) -> str | None:
    """A Gemma 3 tensor under Gemma3ForCausalLM's name: a ConditionalGeneration file's text model
    renamed, its vision tower and projector None (left out); a text model's name as it is."""
    if _VISION_PART.match(name):
        return None
    for pattern, replacement in _TEXT_PART:
        if pattern.match(name):
            return pattern.sub(replacement, name, count=1)
    return name


def gemma_model_fields(config: dict, family: str, where: str) -> dict:
    """ModelConfig's fields from a Gemma 2 or Gemma 3 text config.json (sizes already checked by
    the caller); refuses what the decoder would compute otherwise, naming the field."""
    defaults = _DEFAULTS[family]
    unsupported = []
    activation = config.get("hidden_activation") or ACTIVATION
    if activation != ACTIVATION:
        unsupported.append(f"hidden_activation={activation!r} (rayshard computes {ACTIVATION})")
    if config.get("attention_bias"):
        unsupported.append("attention_bias=True")
    if config.get("use_bidirectional_attention"):
        unsupported.append("use_bidirectional_attention=True")
    for key in ("query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "rope_local_base_freq"):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not math.isfinite(value) or value <= 0):
            raise CheckpointError(f"{where}: {key}={value!r} is not a positive finite number. Fix: restore the file")
    layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types is None:  # as the config class derives them
        pattern = config.get("sliding_window_pattern", defaults["pattern"])
        if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
            raise CheckpointError(f"{where}: sliding_window_pattern={pattern!r} is not a positive whole number. "
                                  "Fix: restore the file")
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    if len(layer_types) != layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        unsupported.append(f"layer_types={layer_types!r} (one of full_attention, sliding_attention per layer)")
    window = config.get("sliding_window", 4096)
    if window is None and "sliding_attention" in layer_types:
        unsupported.append("sliding_window=None with sliding_attention layers")
    head_dim = config.get("head_dim") or 256
    if family == "gemma3":
        global_rope, local_theta = _gemma3_rope(config, defaults, where)
        rope, rope_scaling = rope_from_hf({**config, "rope_scaling": None, "rope_parameters": global_rope}, head_dim, where)
    else:
        local_theta = None
        rope, rope_scaling = rope_from_hf(config, head_dim, where)
    if unsupported:
        raise CheckpointError(f"{where}: this {family} model uses {', '.join(unsupported)}, which rayshard does not "
                              "implement; importing it would change what the weights compute")
    heads = config["num_attention_heads"]
    attn_cap = config.get("attn_logit_softcapping", defaults["attn_logit_softcapping"]) if family == "gemma2" else None
    logit_cap = config.get("final_logit_softcapping", defaults["final_logit_softcapping"])
    return dict(
        vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=layers, n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads, ffn_dim=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", defaults["max_position_embeddings"]),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", defaults["rope_theta"]))),
        rope_scaling=rope_scaling, norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(config.get("tie_word_embeddings", True)), family=family,
        head_size=head_dim if head_dim != config["hidden_size"] // heads else None,
        norm="rmsnorm_plus_one", mlp="geglu_tanh", post_norms=True, embedding_scale=True, qk_norm=family == "gemma3",
        query_pre_attn_scalar=config.get("query_pre_attn_scalar", 256),
        attn_softcap=float(attn_cap) if attn_cap is not None else None,
        logit_softcap=float(logit_cap) if logit_cap is not None else None,
        sliding_window=int(window) if window is not None else None, layer_types=tuple(layer_types),
        rope_local_theta=local_theta)


def _gemma3_rope(config: dict, defaults: dict, where: str) -> tuple[dict, float]:
    """Gemma 3's full layers' RoPE parameters and its sliding layers' base, as Gemma3TextConfig
    reads them: transformers 5's rope_parameters per layer type, with 4.x's rope_scaling merged
    into the full layers' and rope_theta / rope_local_base_freq as the bases' defaults. The
    sliding layers rotate without scaling; a scaling there is refused naming it."""
    parameters = config.get("rope_parameters") or {}
    per_type = "full_attention" in parameters or "sliding_attention" in parameters
    full = dict((parameters.get("full_attention") if per_type else parameters) or {})
    sliding = dict((parameters.get("sliding_attention") if per_type else None) or {})
    if config.get("rope_scaling"):
        full.update(config["rope_scaling"])
    full.setdefault("rope_theta", config.get("rope_theta", defaults["rope_theta"]))
    local_theta = sliding.get("rope_theta", config.get("rope_local_base_freq", defaults["rope_local_base_freq"]))
    local_type = sliding.get("rope_type", sliding.get("type", "default"))
    if local_type != "default":
        raise CheckpointError(f"{where}: this gemma3 model uses rope_parameters.sliding_attention.rope_type="
                              f"{local_type!r}, which rayshard does not implement (its sliding layers rotate with "
                              "default RoPE); importing it would change what the weights compute")
    if not isinstance(local_theta, (int, float)) or isinstance(local_theta, bool) or not local_theta > 0:
        raise CheckpointError(f"{where}: the sliding layers' rope_theta={local_theta!r} is not a positive number. "
                              "Fix: restore the file")
    return full, float(local_theta)
