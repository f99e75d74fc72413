"""GPT-2 (`GPT2LMHeadModel`) as a family of the one decoder: its config.json and tensor names.

GPT-2 is the decoder with the switches of decision 132: learned absolute positions
(`transformer.wpe`), LayerNorms with bias, a GELU feed-forward without gate, biases on every
projection, one kv head per query head, and (by default) the head tied to the token embedding.

Its tensors differ from ours in two ways, both mapping rules, so the same rules move the AdamW
moments and import is their derived inverse:
- every block projection is a Conv1D, whose weight is [in, out], the transpose of nn.Linear's
  (Transpose);
- `c_attn` fuses q, k and v by output columns, [all q heads | all k heads | all v heads]; ours
  are grouped per kv head (here per head: [q_h, k_h, v_h]), so the split recovers plain q, k, v
  (n_heads groups of one head each) and a one-group concatenation fuses them part after part, as
  Phi-3's qkv_proj. Biases split and fuse the same way, without the transpose.

A GPT2Config that asks for what the decoder does not compute is refused naming the field:
`scale_attn_by_inverse_layer_idx`, `reorder_and_upcast_attn` (an fp16 upcast, but also another
order of operations), `scale_attn_weights` false, `add_cross_attention`, an activation other than
the GELUs (`gelu_new`, `gelu_pytorch_tanh`: the tanh approximation; `gelu`: exact).
"""
from __future__ import annotations

import math
import re

from rayshard.plans.errors import CheckpointError
from rayshard.plans.transforms.mapping import Alias, Cast, ConcatRows, Mapping, Rename, SplitRows, Transpose
from rayshard.plans.training.model_spec import ModelConfig

ARCHITECTURE = "GPT2LMHeadModel"
# config.json's activation_function -> our mlp switch. Export writes gelu_new for the tanh form.
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
EXPORTED_ACTIVATION = {"gelu_tanh": "gelu_new", "gelu": "gelu"}
# Fields whose other values change what GPT2LMHeadModel computes, with the value we compute.
_EXPECTED = (("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
             ("scale_attn_weights", True), ("add_cross_attention", False))
_CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
# The causal mask (and older transformers' masked-attention fill value) that GPT-2 files on the
# Hub still carry as tensors: buffers derived from n_positions, no weights.
_MASK_BUFFER = re.compile(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)\Z")


def gpt2_hub_name(name: str) -> str | None:
    """A tensor of a GPT-2 file under the name save_pretrained of transformers 5 writes (the Hub's
    openai-community/gpt2 was saved from the base model: `wte.weight`, `h.0.attn.c_attn.weight`,
    no `transformer.` prefix); None for a mask buffer, which the import leaves out."""
    if _MASK_BUFFER.match(name):
        return None
    return name if name.startswith("transformer.") or name == "lm_head.weight" else "transformer." + name


def gpt2_projection_weights(layer: int) -> dict[str, str]:
    """Each attention projection's weight where `gpt2_mapping` has it alone and as nn.Linear
    stores it, [out, in], in export order of rows: q, k and v between their split and the fusion
    into c_attn, o before its Conv1D transpose. A LoRA merge adds its delta there."""
    hf = f"transformer.h.{layer}.attn."
    return {**{part: hf + f"{part}_plain.weight" for part in "qkv"}, "o": hf + "c_proj.weight"}


def gpt2_mapping(model: ModelConfig, dtype: str | None = None) -> Mapping:
    """Our names -> GPT2LMHeadModel's (what its save_pretrained writes), in the export direction."""
    refuse_unexportable_gpt2(model)
    ours, hf = "layers.{layer}.", "transformer.h.{layer}."
    head, dim = model.head_dim, model.dim
    rules: list = [Rename("tok_embeddings.weight", "transformer.wte.weight"),
                   Rename("pos_embeddings.weight", "transformer.wpe.weight")]
    for leaf in ("weight", "bias"):
        plain = tuple(hf + f"attn.{part}_plain.{leaf}" for part in "qkv")  # only between the two rules (as gpt2_projection_weights)
        rules += [Rename(ours + f"attention_norm.{leaf}", hf + f"ln_1.{leaf}"),
                  SplitRows(ours + f"attention.qkv.{leaf}", plain, (head, head, head), model.n_heads),
                  ConcatRows(plain, hf + f"attn.c_attn.{leaf}", (dim, dim, dim), 1),
                  Rename(ours + f"attention.wo.{leaf}", hf + f"attn.c_proj.{leaf}"),
                  Rename(ours + f"ffn_norm.{leaf}", hf + f"ln_2.{leaf}"),
                  Rename(ours + f"feed_forward.up.{leaf}", hf + f"mlp.c_fc.{leaf}"),
                  Rename(ours + f"feed_forward.down.{leaf}", hf + f"mlp.c_proj.{leaf}"),
                  Rename(f"norm.{leaf}", f"transformer.ln_f.{leaf}")]
    rules += [Transpose(hf + f"{conv}.weight") for conv in _CONV1D]
    rules.append(Alias("lm_head.weight", of="transformer.wte.weight") if model.tie_embeddings
                 else Rename("output.weight", "lm_head.weight"))
    if dtype and dtype != "float32":
        rules.append(Cast("*", to=dtype, source="float32"))
    return Mapping(tuple(rules))


def refuse_unexportable_gpt2(model: ModelConfig) -> None:
    """What GPT2LMHeadModel computes that this model does not (or the other way round)."""
    problems = (
        (model.position_embedding != "learned", f"position_embedding={model.position_embedding!r}", "learned"),
        (model.norm != "layernorm", f"norm={model.norm!r}", "layernorm"),
        (model.mlp not in EXPORTED_ACTIVATION, f"mlp={model.mlp!r}", "gelu_tanh (gelu_new) or gelu"),
        (not (model.qkv_bias and model.wo_bias and model.mlp_bias), "qkv_bias/wo_bias/mlp_bias", "all three True"),
        (model.n_kv_heads != model.n_heads, f"n_kv_heads={model.n_kv_heads}", f"n_heads ({model.n_heads})"),
        (model.head_dim * model.n_heads != model.dim, f"head_size={model.head_size}", "unset (dim / n_heads)"),
        (model.qk_norm or model.sliding_window is not None or model.is_moe, "qk_norm/sliding_window/n_experts",
         "none of them"),
    )
    for wrong, setting, fix in problems:
        if wrong:
            raise CheckpointError(f"cannot export this gpt2 model: model.{setting} is not what {ARCHITECTURE} computes. "
                                  f"Fix: train with {fix}")


def gpt2_config(model: ModelConfig, dtype: str) -> dict:
    """config.json as GPT2Config reads it (its own field names), set to what our model computes.
    Dropouts are written as 0: rayshard trains without them."""
    config = {
        "architectures": [ARCHITECTURE], "model_type": "gpt2", "vocab_size": model.vocab_size, "n_embd": model.dim,
        "n_layer": model.n_layers, "n_head": model.n_heads, "n_positions": model.max_seq_len, "n_inner": model.ffn_dim,
        "activation_function": EXPORTED_ACTIVATION[model.mlp], "layer_norm_epsilon": model.norm_eps,
        **dict(_EXPECTED), "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
        "tie_word_embeddings": model.tie_embeddings, "torch_dtype": dtype, "dtype": dtype,
        # GPT2Config defaults both to 50256, past a smaller vocabulary: a model that names none says so.
        "bos_token_id": None, "eos_token_id": None,
    }
    if model.special_tokens is not None:
        config.update(model.special_tokens.hf_fields())
    return config


def gpt2_model_fields(config: dict, where: str) -> dict:
    """ModelConfig's fields from a GPT-2 config.json (GPT2Config's names and defaults); refuses
    what the decoder would compute otherwise, naming the field."""
    missing = [key for key in ("vocab_size", "n_embd", "n_layer", "n_head") if config.get(key) is None]
    if missing:
        raise CheckpointError(f"{where}: this gpt2 config.json has no {', '.join(missing)}. Fix: restore the file, or "
                              "save it again with transformers' save_pretrained")
    for key in ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner"):
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise CheckpointError(f"{where}: {key}={value!r} is not a positive whole number. Fix: restore the file")
    eps = config.get("layer_norm_epsilon", 1e-5)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not math.isfinite(eps) or eps <= 0:
        raise CheckpointError(f"{where}: layer_norm_epsilon={eps!r} is not a positive finite number. Fix: restore the file")
    unsupported = [f"{key}={config[key]!r}" for key, fine in _EXPECTED if key in config and config[key] != fine]
    activation = config.get("activation_function", "gelu_new")
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        unsupported.append(f"activation_function={activation!r} (rayshard computes {', '.join(ACTIVATIONS)})")
    if config["n_embd"] % config["n_head"]:
        unsupported.append(f"n_head={config['n_head']} (does not divide n_embd={config['n_embd']})")
    if unsupported:
        raise CheckpointError(f"{where}: this gpt2 model uses {', '.join(unsupported)}, which rayshard does not "
                              "implement; importing it would change what the weights compute")
    return dict(vocab_size=config["vocab_size"], dim=config["n_embd"], n_layers=config["n_layer"],
                n_heads=config["n_head"], n_kv_heads=config["n_head"], ffn_dim=config.get("n_inner") or 4 * config["n_embd"],
                max_seq_len=config.get("n_positions", 1024), norm_eps=float(eps),
                tie_embeddings=bool(config.get("tie_word_embeddings", True)), family="gpt2",
                position_embedding="learned", norm="layernorm", mlp=ACTIVATIONS[activation],
                qkv_bias=True, wo_bias=True, mlp_bias=True)
