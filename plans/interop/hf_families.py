"""Hugging Face model families: our parameter names <-> theirs, and our ModelConfig <-> config.json.

One decoder (`plans/training/model_spec.py`) expresses eleven families; each differs from Llama by
what transformers' class computes:

- llama (`LlamaForCausalLM`): the base.
- qwen2 (`Qwen2ForCausalLM`): q, k and v projections carry biases (always, in transformers).
- qwen3 (`Qwen3ForCausalLM`): no biases; q and k are RMS-normalised per head before RoPE; the head
  size is explicit (`head_dim`, not hidden_size / num_attention_heads).
- mistral (`MistralForCausalLM`): sliding-window attention where `sliding_window` is set.
- qwen2_moe (`Qwen2MoeForCausalLM`): qwen2's attention; layer i is a mixture of experts when
  (i + 1) % decoder_sparse_step == 0 (our moe_every), with a shared expert gated by
  sigmoid(shared_expert_gate(x)). Its routing (softmax in fp32, top-k, optional renormalisation
  of the k weights: norm_topk_prob) is exactly ours (`actors/model/moe.py`).
- qwen3_moe (`Qwen3MoeForCausalLM`): qwen3's attention, the same experts, no shared expert.
- phi3 (`Phi3ForCausalLM`): Llama's computation (and Mistral's optional sliding window) with
  fused tensors in the Hub: `qkv_proj` is [all q heads; all k heads; all v heads] and
  `gate_up_proj` is [all gate rows; all up rows] (transformers chunks it in two), so the mapping
  splits ours (grouped per kv head, interleaved per hidden unit) and concatenates the parts.
- gpt2 (`GPT2LMHeadModel`): the decoder's GPT-2 switches (learned positions, LayerNorm, GELU
  MLP, biases everywhere) with transposed Conv1D weights and q|k|v fused by columns
  (`plans/interop/hf_gpt2.py`).
- mixtral (`MixtralForCausalLM`): Mistral's attention, every layer a mixture of experts with no
  shared expert, routed by softmax top-k with the k weights always renormalised (our norm_topk);
  experts live in `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down), each expert
  `intermediate_size` wide.
- gemma2 (`Gemma2ForCausalLM`), gemma3 (`Gemma3ForCausalLM`, model_type gemma3_text; and the text
  model of a `Gemma3ForConditionalGeneration` directory): the decoder's Gemma switches ((1 + weight)
  norms before and after each sublayer, scaled embedding, GeGLU, soft-capping, per-layer sliding
  windows, local/global RoPE), Llama's tensors with Gemma's norm names (`plans/interop/hf_gemma.py`).

Experts are written in the Hub's per-expert form (`mlp.experts.{e}.gate_proj.weight` [F, D],
`up_proj`, `down_proj` [D, F]): what `save_pretrained` of transformers 5.24 writes, what its
`from_pretrained` converts into its fused in-memory `gate_up_proj` (gate rows first), and what
older transformers and other readers expect. An MoE model transformers would compute otherwise
(sigmoid router scores, a qwen2_moe without shared expert, ...) is refused at export naming the
setting; a config.json with `mlp_only_layers` at import.

A config.json that asks for something this decoder does not compute (a RoPE scaling type other
than linear, dynamic, yarn and llama3, an unknown `model_type`, attention bias where the family
has none, a per-layer sliding window) is refused naming the field: importing it would change what
the weights compute. RoPE scaling and the bos / eos / pad ids are kept in the ModelConfig and
written back at export (`rope_parameters` and 4.x's `rope_scaling`; the ids in config.json).

The mapping is written once, in the export direction; import uses its derived inverse.
A user's model (`--model-factory`) brings its own mapping and config.json in its plan
(`ModelPlan.hf_mapping` / `hf_config`); `export_mapping` and `export_config` pick either.
"""
from __future__ import annotations

import re

import math

from rayshard.plans.transforms.codec import decode_mapping
from rayshard.plans.transforms.mapping import Alias, Cast, ConcatRows, Mapping, Rename, SplitRows, Unstack
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.plans.interop.hf_gemma import (GEMMA_ARCHITECTURES, GEMMA_MODEL_TYPES, gemma3_text_name, gemma_config,
                                             gemma_mapping, gemma_model_fields, text_config_of)
from rayshard.plans.interop.hf_gpt2 import gpt2_config, gpt2_hub_name, gpt2_mapping, gpt2_model_fields
from rayshard.plans.interop.hf_rope import rope_from_hf
from rayshard.plans.training.model_spec import MOE_FAMILIES, ModelConfig
from rayshard.plans.training.special_tokens import SpecialTokens

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM", "gpt2": "GPT2LMHeadModel",
                 **GEMMA_ARCHITECTURES}
# Families whose class computes a sliding window where config.json's sliding_window is set.
SLIDING_WINDOW_FAMILIES = ("mistral", "phi3", "mixtral")
# Hub families rayshard does not compute, each with what its class computes that ours does not:
# named in the refusal so the user knows whether it is a missing family or a missing feature.
NOT_COMPUTED: dict[str, str] = {}


def hf_mapping(model: ModelConfig, dtype: str | None = None) -> Mapping:
    """Our parameter names -> transformers' names for the model's family (cast to `dtype` if given).

    qkv rows are grouped per kv head g: [q heads g*r .. g*r+r-1, k_g, v_g] (r query heads per kv
    head), so the split takes n_kv_heads groups of (r*head_dim, head_dim, head_dim) rows and
    q_proj comes out in plain head order; Qwen2's biases split the same way. gate_up interleaves
    (gate_j, up_j) per hidden unit: ffn_dim groups of (1, 1) rows. RoPE already uses the
    rotate-half convention transformers uses, so q and k rows need no permutation.
    An MoE layer's stacked experts unstack into the Hub's per-expert tensors (`moe_rules`).
    """
    if model.family == "gpt2":  # plans/interop/hf_gpt2.py
        return gpt2_mapping(model, dtype)
    if model.family in GEMMA_ARCHITECTURES:  # plans/interop/hf_gemma.py
        return gemma_mapping(model, dtype)
    refuse_gpt2_switches(model)
    if model.family in MOE_FAMILIES:
        refuse_unexportable_moe(model)
    if model.family == "phi3" and (model.qkv_bias or model.qk_norm):
        raise CheckpointError("cannot export this phi3 model: model.qkv_bias/qk_norm is not what Phi3ForCausalLM computes. "
                              "Fix: train without them, or use family qwen2 (biases) or qwen3 (q/k norms)")
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
    if model.family == "phi3":
        rules += phi3_fusion_rules(model)
    if model.is_moe:
        rules += mixtral_expert_rules(model) if model.family == "mixtral" else moe_rules(model)
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


# GPT-2's switches (decision 132) and Gemma's (decision 143), at the values the Llama-like classes compute.
DECODER_SWITCHES = (("position_embedding", "rope"), ("norm", "rmsnorm"), ("mlp", "swiglu"), ("wo_bias", False),
                    ("mlp_bias", False), ("post_norms", False), ("embedding_scale", False),
                    ("query_pre_attn_scalar", None), ("attn_softcap", None), ("logit_softcap", None),
                    ("layer_types", None), ("rope_local_theta", None))


def refuse_gpt2_switches(model: ModelConfig) -> None:
    """GPT-2's and Gemma's switches are no part of what the Llama-like classes compute."""
    switched = [f"{name}={getattr(model, name)!r}" for name, default in DECODER_SWITCHES if getattr(model, name) != default]
    if switched:
        raise CheckpointError(f"cannot export this {model.family} model: model.{', '.join(switched)} is not what "
                              f"{ARCHITECTURES[model.family]} computes. Fix: train with family gpt2 or gemma2/gemma3, "
                              "or without them")


def phi3_fusion_rules(model: ModelConfig) -> list:
    """Phi-3 fuses q, k and v (and gate and up) too, but part after part rather than per kv head
    (per hidden unit): the plain q, k, v (gate, up) the split above yields are concatenated whole,
    one group. The intermediate names exist only between the two rules."""
    hf_layer = "model.layers.{layer}."
    q_rows, kv_rows = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    return [ConcatRows(tuple(hf_layer + f"self_attn.{p}_proj.weight" for p in "qkv"), hf_layer + "self_attn.qkv_proj.weight",
                       (q_rows, kv_rows, kv_rows), 1),
            ConcatRows((hf_layer + "mlp.gate_proj.weight", hf_layer + "mlp.up_proj.weight"), hf_layer + "mlp.gate_up_proj.weight",
                       (model.ffn_dim, model.ffn_dim), 1)]


def mixtral_expert_rules(model: ModelConfig) -> list:
    """Mixtral's experts under `block_sparse_moe`: w1 the gate, w3 the up, w2 the down projection
    (what save_pretrained of transformers 5.24 writes back from its fused in-memory experts)."""
    ours, hf = "layers.{layer}.feed_forward.", "model.layers.{layer}.block_sparse_moe."
    expert = hf + "experts.{expert}."
    return [Rename(ours + "router.weight", hf + "gate.weight"),
            Unstack(ours + "experts.gate_up.weight", expert + "gate_up_interleaved", model.n_experts),
            SplitRows(expert + "gate_up_interleaved", (expert + "w1.weight", expert + "w3.weight"), (1, 1),
                      model.expert_ffn_dim),
            Unstack(ours + "experts.down.weight", expert + "w2.weight", model.n_experts)]


def moe_rules(model: ModelConfig) -> list:
    """An MoE layer's tensors. Each expert's gate_up interleaves (gate_j, up_j) like the dense one,
    so after unstacking the same (1, 1)-row split gives gate_proj and up_proj. down's experts are
    unstacked last, so on import (the inverse runs the rules backwards) they are stacked first:
    an expert dropped or renumbered is then named by its Hub key (`...experts.3.down_proj.weight`)."""
    ours, hf = "layers.{layer}.feed_forward.", "model.layers.{layer}.mlp."
    expert = hf + "experts.{expert}."
    rules = [Rename(ours + "router.weight", hf + "gate.weight"),
             # The per-expert fused tensor only exists between these two rules.
             Unstack(ours + "experts.gate_up.weight", expert + "gate_up_interleaved", model.n_experts),
             SplitRows(expert + "gate_up_interleaved", (expert + "gate_proj.weight", expert + "up_proj.weight"), (1, 1),
                       model.expert_ffn_dim),
             Unstack(ours + "experts.down.weight", expert + "down_proj.weight", model.n_experts)]
    if model.shared_expert_ffn_dim:
        rules += [SplitRows(ours + "shared.gate_up.weight", (hf + "shared_expert.gate_proj.weight",
                                                              hf + "shared_expert.up_proj.weight"), (1, 1),
                            model.shared_expert_ffn_dim),
                  Rename(ours + "shared.down.weight", hf + "shared_expert.down_proj.weight"),
                  Rename(ours + "shared_gate.weight", hf + "shared_expert_gate.weight")]
    return rules


def refuse_unexportable_moe(model: ModelConfig) -> None:
    """What the family's transformers class would compute differently from our MoE model."""
    family = model.family
    problems = (
        (model.router_scores != "softmax", f"router_scores={model.router_scores!r}",
         f"{ARCHITECTURES[family]} routes by softmax scores; train with router_scores 'softmax' to export"),
        (family == "qwen2_moe" and not model.shared_expert_ffn_dim, "shared_expert_ffn_dim=0",
         "Qwen2MoeForCausalLM always adds a shared expert; set shared_expert_ffn_dim, or use family qwen3_moe"),
        (family == "qwen3_moe" and model.shared_expert_ffn_dim > 0, f"shared_expert_ffn_dim={model.shared_expert_ffn_dim}",
         "Qwen3MoeForCausalLM has no shared expert; set it to 0, or use family qwen2_moe"),
        (family == "qwen2_moe" and model.qk_norm, "qk_norm=True",
         "Qwen2MoeForCausalLM does not normalise q and k; use family qwen3_moe"),
        (family == "qwen3_moe" and not model.qk_norm, "qk_norm=False",
         "Qwen3MoeForCausalLM always normalises q and k per head; set qk_norm, or use family qwen2_moe"),
        (family == "qwen3_moe" and model.qkv_bias, "qkv_bias=True",
         "Qwen3MoeForCausalLM's attention_bias also adds an o_proj bias rayshard does not have; use family qwen2_moe"),
        (model.sliding_window is not None and family not in SLIDING_WINDOW_FAMILIES, f"sliding_window={model.sliding_window}",
         f"{ARCHITECTURES[family]} as exported attends to every earlier token; train without a sliding window"),
        (family == "mixtral" and not model.norm_topk, "norm_topk=False",
         "MixtralForCausalLM always renormalises the k routing weights to sum to 1; set norm_topk"),
        (family == "mixtral" and model.shared_expert_ffn_dim > 0, f"shared_expert_ffn_dim={model.shared_expert_ffn_dim}",
         "MixtralForCausalLM has no shared expert; set it to 0, or use family qwen2_moe"),
        (family == "mixtral" and model.moe_every != 1, f"moe_every={model.moe_every}",
         "every MixtralForCausalLM layer is a mixture of experts; set moe_every 1"),
        (family == "mixtral" and (model.qkv_bias or model.qk_norm), "qkv_bias/qk_norm",
         "MixtralForCausalLM's attention has neither; use family qwen2_moe or qwen3_moe"),
    )
    for wrong, setting, fix in problems:
        if wrong:
            raise CheckpointError(f"cannot export this {family} model: model.{setting} is not what {ARCHITECTURES[family]} "
                                  f"computes. Fix: {fix}")


def hub_names(model: ModelConfig, tensors: dict) -> dict:
    """A directory's tensors under the names today's save_pretrained writes, without the buffers
    older files carry (GPT-2's Hub files: no `transformer.` prefix, the causal masks `attn.bias`).
    A Gemma3ForConditionalGeneration file's text model is taken under Gemma3ForCausalLM's names,
    its vision tower and projector left out (`import_hf` says so). Other families' names are taken
    as they are. Every family's rotary `inv_freq` buffers are left out: files saved before
    transformers 4.31 carry them, derived from the config (transformers ignores them too)."""
    tensors = {name: tensor for name, tensor in tensors.items() if not ROTARY_BUFFER.search(name)}
    rename = {"gpt2": gpt2_hub_name, "gemma3": gemma3_text_name}.get(model.family)
    if rename is None:
        return tensors
    return {hub: tensor for name, tensor in tensors.items() if (hub := rename(name)) is not None}


# A rotary embedding's inverse frequencies, a buffer older save_pretrained wrote with the weights
# (`model.layers.0.self_attn.rotary_emb.inv_freq`, `model.rotary_emb.inv_freq`).
ROTARY_BUFFER = re.compile(r"(^|\.)rotary_emb\.inv_freq\Z")


def export_mapping(model: ModelConfig, dtype: str | None = None, source_dtype: str = "float32") -> Mapping:
    """The export mapping of a built-in family or of a user's plan, cast from the stored
    `source_dtype` to `dtype` where they differ (a bf16 run exported as float16 is cast, not
    written as bf16 under a float16 config.json)."""
    mapping = hf_mapping(model) if model.user is None else decode_mapping(_user_plan_for_export(model).hf_mapping)
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
                          "give its ModelPlan hf_mapping (rules as data, plans/transforms/codec.py) and "
                          "hf_config (config.json contents), as examples/gpt2/model.py does, and train or resume with it")
    return plan


def hf_config(model: ModelConfig, dtype: str) -> dict:
    """config.json for the model's family."""
    if model.family == "gpt2":
        return gpt2_config(model, dtype)
    if model.family in GEMMA_ARCHITECTURES:
        return gemma_config(model, dtype)
    config = {
        "architectures": [ARCHITECTURES[model.family]], "model_type": model.family,
        "vocab_size": model.vocab_size, "hidden_size": model.dim, "intermediate_size": model.ffn_dim,
        "num_hidden_layers": model.n_layers, "num_attention_heads": model.n_heads,
        "num_key_value_heads": model.n_kv_heads, "head_dim": model.head_dim,
        "max_position_embeddings": model.max_seq_len, "rms_norm_eps": model.norm_eps,
        # Both spellings: transformers 5 reads rope_parameters, 4.x reads rope_theta (and rope_scaling).
        "rope_theta": model.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
        "tie_word_embeddings": model.tie_embeddings, "hidden_act": "silu", "torch_dtype": dtype, "dtype": dtype,
    }
    if model.rope_scaling is not None:
        scaling = model.rope_scaling.to_dict()
        config["rope_parameters"] = {**scaling, "rope_theta": model.rope_theta}
        config["rope_scaling"] = scaling  # transformers 5 prefers it when both are given; they agree
    if model.special_tokens is not None:
        config.update(model.special_tokens.hf_fields())
    if model.family in ("llama", "qwen3"):
        config["attention_bias"] = False
    if model.family == "llama":
        config["mlp_bias"] = False
    if model.family in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None)
    if model.family in SLIDING_WINDOW_FAMILIES:
        config["sliding_window"] = model.sliding_window
    if model.family == "phi3":
        # Phi3Config defaults pad_token_id to Phi-3's 32000, which its embedding refuses for a
        # smaller vocabulary: a model that names no pad id says so.
        if config.get("pad_token_id") is None and model.vocab_size <= 32000:
            config["pad_token_id"] = None
        # transformers gives the top-level original_max_position_embeddings priority over the
        # scaling's own (llama3/yarn): with scaling, it must be the scaling's, not max_seq_len.
        scaled = model.rope_scaling is not None and model.rope_scaling.original_max_position_embeddings is not None
        config.update(original_max_position_embeddings=(model.rope_scaling.original_max_position_embeddings if scaled
                                                        else model.max_seq_len), resid_pdrop=0.0, embd_pdrop=0.0)
    if model.family == "mixtral":
        config.update(num_local_experts=model.n_experts, num_experts_per_tok=model.experts_per_token,
                      intermediate_size=model.expert_ffn_dim, router_aux_loss_coef=model.aux_loss_coef,
                      output_router_logits=False, router_jitter_noise=0.0)
    if model.family in ("qwen2_moe", "qwen3_moe"):
        config.update(
            num_experts=model.n_experts, num_experts_per_tok=model.experts_per_token,
            moe_intermediate_size=model.expert_ffn_dim, decoder_sparse_step=model.moe_every, mlp_only_layers=[],
            norm_topk_prob=model.norm_topk,
            # A training setting only: transformers adds it when asked for router logits, over its
            # whole batch; ours is per sequence (actors/model/moe.py). Logits do not depend on it.
            router_aux_loss_coef=model.aux_loss_coef, output_router_logits=False,
            use_sliding_window=False, sliding_window=None)
    if model.family == "qwen2_moe":
        config.update(shared_expert_intermediate_size=model.shared_expert_ffn_dim, qkv_bias=model.qkv_bias)
    if model.family == "qwen3_moe":
        config["attention_bias"] = False
    return config


# What each family's transformers config class takes for a key its config.json leaves out (the
# classes' defaults, transformers 4.45 to 5.x; tests/unit/test_hf_families.py checks this table
# against the installed classes): a missing key means to the import what it means to
# transformers. num_key_value_heads None: as many as the attention heads.
HF_DEFAULTS: dict[str, dict] = {
    "llama": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=2048, num_key_value_heads=None),
    "mistral": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=131072, num_key_value_heads=8,
                    sliding_window=4096),
    "qwen2": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=32768, num_key_value_heads=32),
    "qwen3": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=32768, num_key_value_heads=32),
    "phi3": dict(rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=4096, num_key_value_heads=None),
    "mixtral": dict(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=131072, num_key_value_heads=8),
    "qwen2_moe": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=32768, num_key_value_heads=16),
    "qwen3_moe": dict(rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=32768, num_key_value_heads=4),
}


def model_config_from_hf(config: dict, where: str) -> ModelConfig:
    """Our ModelConfig from a config.json of a family we compute; refuses what we would approximate."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise CheckpointError(f"{where}: model_type={model_type!r} is not a name (a string such as 'llama'). Fix: restore "
                              "the file")
    if model_type == "gemma3":  # Gemma3ForConditionalGeneration: its text model (plans/interop/hf_gemma.py)
        config, model_type = text_config_of(config, where), "gemma3_text"
    if model_type in NOT_COMPUTED:
        raise CheckpointError(f"{where}: model_type {model_type!r} is not one rayshard computes yet: it would need "
                              f"{NOT_COMPUTED[model_type]}; supported: {', '.join(sorted(ARCHITECTURES))}")
    family = GEMMA_MODEL_TYPES.get(model_type, model_type)  # gemma3_text is family gemma3
    if family not in ARCHITECTURES:
        raise CheckpointError(f"{where}: model_type {family!r} is not one rayshard computes; supported: "
                              f"{', '.join(sorted(ARCHITECTURES))}")
    if family == "gpt2":  # GPT2Config's own field names (plans/interop/hf_gpt2.py)
        return ModelConfig(**gpt2_model_fields(config, where), special_tokens=special_tokens_from_hf(config, where)).validate()
    _check_numbers(config, family, where)
    if family in GEMMA_ARCHITECTURES:  # plans/interop/hf_gemma.py
        return ModelConfig(**gemma_model_fields(config, family, where),
                           special_tokens=special_tokens_from_hf(config, where)).validate()
    defaults = HF_DEFAULTS[family]
    config = {**{key: value for key, value in defaults.items() if value is not None}, **config}
    unsupported = [f"{key}={config[key]!r}" for key, fine in _EXPECTED[family] if key in config and config[key] != fine]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope, rope_scaling = rope_from_hf(config, head_dim, where)
    if family in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and config.get("use_sliding_window"):
        unsupported.append(f"use_sliding_window={config['use_sliding_window']!r}")
    layer_types = set(config.get("layer_types") or ())
    if layer_types - {"full_attention", "sliding_attention"} or (family not in SLIDING_WINDOW_FAMILIES and "sliding_attention" in layer_types):
        unsupported.append(f"layer_types={sorted(layer_types)!r}")
    if family == "qwen2" and head_dim != config["hidden_size"] // heads:  # Qwen2's class ignores head_dim
        unsupported.append(f"head_dim={head_dim} (Qwen2 computes hidden_size / num_attention_heads)")
    if family in MOE_FAMILIES:
        unsupported += _unsupported_moe(config)
    if unsupported:
        raise CheckpointError(f"{where}: this {family} model uses {', '.join(unsupported)}, which rayshard does not "
                              "implement; importing it would change what the weights compute")
    sliding_window = config.get("sliding_window") if family in SLIDING_WINDOW_FAMILIES else None
    experts = _experts_from_hf(config) if family in MOE_FAMILIES else {}
    return ModelConfig(
        vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
        n_heads=heads, n_kv_heads=config.get("num_key_value_heads") or heads, ffn_dim=config["intermediate_size"],
        max_seq_len=config["max_position_embeddings"],
        rope_theta=_rope_theta(rope, config, where), rope_scaling=rope_scaling,
        special_tokens=special_tokens_from_hf(config, where),
        norm_eps=float(config["rms_norm_eps"]), tie_embeddings=_switch(config, "tie_word_embeddings", False, where),
        family=family, qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(config.get("qkv_bias", True))),
        qk_norm=family in ("qwen3", "qwen3_moe"), sliding_window=int(sliding_window) if sliding_window else None,
        head_size=head_dim if head_dim != config["hidden_size"] // heads else None, **experts,
    ).validate()


def _rope_theta(rope: dict, config: dict, where: str) -> float:
    """RoPE's base, from the rope parameters or the top level (transformers 4.x), a positive
    finite number (0 or less gives every position the same angle: NaN logits)."""
    key = "rope_theta" if "rope_theta" not in rope else "rope_parameters.rope_theta"
    value = rope.get("rope_theta", config.get("rope_theta"))
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise CheckpointError(f"{where}: {key}={value!r} is not a positive finite number (RoPE's base). Fix: restore the "
                              "file")
    return float(value)


def _switch(config: dict, key: str, default: bool, where: str) -> bool:
    """A true/false key of config.json; a string such as "false" is refused, not read as True."""
    value = config.get(key)
    if value is None:  # absent, or written as null: the class's default
        return default
    if not isinstance(value, bool):
        raise CheckpointError(f"{where}: {key}={value!r} is not true or false. Fix: restore the file")
    return value


def special_tokens_from_hf(config: dict, where: str) -> SpecialTokens | None:
    """A config.json's bos / eos / pad ids (None when it names none); a malformed one is named."""
    values = {}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = config.get(key)
        if value is None:
            continue
        ids = value if key == "eos_token_id" and isinstance(value, list) else [value]
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise CheckpointError(f"{where}: {key}={value!r} is not a token id (a whole number 0 or more"
                                  f"{', or a list of them' if key == 'eos_token_id' else ''}). Fix: restore the file")
        values[key] = value
    return SpecialTokens(**values) if values else None


def _unsupported_moe(config: dict) -> list[str]:
    """MoE settings of a config.json that our model would not compute as transformers does."""
    unsupported = []
    if config.get("mlp_only_layers"):  # dense layers outside the every-n-th rule: not expressible by moe_every
        unsupported.append(f"mlp_only_layers={config['mlp_only_layers']!r}")
    if not _n_experts(config):
        unsupported.append(f"num_experts={_n_experts(config)!r} (no expert layers: import it as a dense family)")
    if config["model_type"] == "qwen2_moe" and not config.get("shared_expert_intermediate_size"):
        unsupported.append(f"shared_expert_intermediate_size={config.get('shared_expert_intermediate_size')!r}")
    return unsupported


def _n_experts(config: dict) -> int | None:
    """The Hub's config.json spells it num_experts; transformers 5's Qwen3MoeConfig saves its
    attribute name, num_local_experts."""
    return config.get("num_experts", config.get("num_local_experts"))


def _experts_from_hf(config: dict) -> dict:
    """Our ModelConfig's expert fields from config.json. Sizes must be given (save_pretrained always
    writes them); the switches take the default both transformers classes share. Mixtral's
    experts are intermediate_size wide, in every layer, their k weights always renormalised."""
    if config["model_type"] == "mixtral":
        return dict(n_experts=config["num_local_experts"], experts_per_token=config["num_experts_per_tok"],
                    expert_ffn_dim=config["intermediate_size"], moe_every=1, norm_topk=True, shared_expert_ffn_dim=0,
                    aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)))
    return dict(n_experts=_n_experts(config), experts_per_token=config["num_experts_per_tok"],
                expert_ffn_dim=config["moe_intermediate_size"], moe_every=config.get("decoder_sparse_step", 1),
                norm_topk=bool(config.get("norm_topk_prob", False)),
                shared_expert_ffn_dim=config["shared_expert_intermediate_size"] if config["model_type"] == "qwen2_moe" else 0,
                aux_loss_coef=float(config.get("router_aux_loss_coef", 0.001)))


# config.json's sizes: those every family needs, those an MoE family needs besides, and those
# that may be absent (or null) and take a default. Checked before any is read, so a damaged or
# hand-written file is named by its key rather than failing in arithmetic.
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
_REQUIRED_MOE_SIZES = ("num_experts_per_tok", "moe_intermediate_size")
_OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "num_experts",
                   "num_local_experts", "decoder_sparse_step", "shared_expert_intermediate_size")
_OPTIONAL_REALS = ("rms_norm_eps", "rope_theta", "router_aux_loss_coef")


def _check_numbers(config: dict, family: str, where: str) -> None:
    required = _REQUIRED_SIZES + (_REQUIRED_MOE_SIZES if family in ("qwen2_moe", "qwen3_moe") else
                                  ("num_experts_per_tok", "num_local_experts") if family == "mixtral" else ())
    missing = [key for key in required if config.get(key) is None]
    if missing:
        raise CheckpointError(f"{where}: this {family} config.json has no {', '.join(missing)}. Fix: restore the "
                              "file, or save it again with transformers' save_pretrained")
    for key in required + tuple(k for k in _OPTIONAL_SIZES if config.get(k) is not None):
        value = config[key]
        zero_allowed = key in ("shared_expert_intermediate_size", "num_experts", "num_local_experts", "sliding_window")
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if zero_allowed else 1):
            raise CheckpointError(f"{where}: {key}={value!r} is not a positive whole number. Fix: restore the file")
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key) is not None and not isinstance(config[key], dict):
            raise CheckpointError(f"{where}: {key}={config[key]!r} is not a JSON object. Fix: restore the file")
    layer_types = config.get("layer_types") or []
    if not isinstance(layer_types, list) or not all(isinstance(kind, str) for kind in layer_types):
        raise CheckpointError(f"{where}: layer_types={config['layer_types']!r} is not a list of names. Fix: restore the file")
    for key in (k for k in _OPTIONAL_REALS if config.get(k) is not None):
        value = config[key]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise CheckpointError(f"{where}: {key}={value!r} is not a finite number. Fix: restore the file")


# config.json keys whose other values change what the family's class computes.
_EXPECTED = {
    "llama": (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)),
    "qwen2": (("hidden_act", "silu"),),
    "qwen3": (("hidden_act", "silu"), ("attention_bias", False)),
    "mistral": (("hidden_act", "silu"),),
    "qwen2_moe": (("hidden_act", "silu"),),
    "qwen3_moe": (("hidden_act", "silu"), ("attention_bias", False)),
    "phi3": (("hidden_act", "silu"),),
    "mixtral": (("hidden_act", "silu"),),
}
