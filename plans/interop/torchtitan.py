"""torchtitan's Llama (`torchtitan/models/llama3/model/model.py`): our parameter names <-> its own,
and where its DCP checkpoints keep the optimizer state.

Its module names are ours where the modules are the same (tok_embeddings, attention_norm,
attention.wo, ffn_norm, norm, output); it keeps q, k and v as separate wq, wk, wv and the SwiGLU
as w1 (gate), w3 (up), w2 (down), where we fuse qkv and gate_up (`plans/training/model_spec.py`).

RoPE: torchtitan rotates complex pairs of ADJACENT elements of each head
(`view_as_complex(x.reshape(..., -1, 2))`), rayshard the two halves (rotate_half, as Hugging Face
does: `actors/model/rope.py`). The same attention therefore needs each q and k head's rows in
another order: our row j < head_dim/2 is its element 2j, row head_dim/2 + j its element 2j+1
(torchtitan's own Hugging Face adapter permutes wq and wk the same way). `RegroupRows` does it,
per head: [2, head_dim/2] rows -> [head_dim/2, 2].

A checkpoint carries no model configuration; the mapping takes ours. torchtitan's Llama with a
configuration this decoder computes differently (rope scaling: torchtitan's llama3 default scales
the low frequencies; a tied output) cannot be recognised from the tensors: the import states the
rope assumption (docs/checkpoints.md).

The mapping is written once, in the export direction (ours -> torchtitan); import uses its derived
inverse, and both apply to the AdamW moments as to the weights.
"""
from __future__ import annotations

from rayshard.plans.checkpoint.chunks import EXP_AVG, EXP_AVG_SQ, PARAM
from rayshard.plans.errors import CheckpointError
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.plans.transforms.mapping import Mapping, RegroupRows, Rename, SplitRows

# Where torchtitan's CheckpointManager puts the optimizer (`OptimizersContainer.state_dict`,
# flattened: `state.<fqn>.<state>`, `param_groups.<fqn>.<setting>`); `optim` is what a plain
# `dcp.save({"model": ..., "optim": get_state_dict(...)[1]})` writes.
OPTIMIZER_PREFIXES = ("optimizer.", "optim.")
# A model state dict saved under a key of its own (`{"model": model_state_dict, ...}`), or at the
# top level as torchtitan flattens it.
MODEL_PREFIXES = ("", "model.")
MOMENT_NAMES = {EXP_AVG: "exp_avg", EXP_AVG_SQ: "exp_avg_sq"}
STEP = "step"
# State outside the model and its AdamW moments: torchtitan's train_state, lr_scheduler and
# dataloader, the optimizer's per-parameter settings. An import reads none of it as tensors.
AUXILIARY_PREFIXES = ("train_state.", "lr_scheduler.", "dataloader.", "optimizer.param_groups.", "optim.param_groups.")
# Buffers torchtitan derives from its configuration (older versions saved the RoPE table).
DERIVED_BUFFERS = ("freqs_cis",)


def refuse_untranslatable(model: ModelConfig) -> None:
    """What torchtitan's Llama has no tensor or setting for."""
    problems = ((model.user is not None, "a user model (family 'user')"),
                (model.is_moe, f"a mixture of experts ({model.n_experts} experts)"),
                (model.qkv_bias, "q/k/v biases (qkv_bias)"),
                (model.qk_norm, "per-head q/k norms (qk_norm)"),
                ((model.position_embedding, model.norm, model.mlp, model.wo_bias, model.mlp_bias) !=
                 ("rope", "rmsnorm", "swiglu", False, False), "GPT-2's learned positions, LayerNorm, GELU MLP or biases"),
                ((model.post_norms, model.embedding_scale, model.query_pre_attn_scalar, model.attn_softcap,
                  model.logit_softcap, model.layer_types, model.rope_local_theta) != (False, False, None, None, None, None, None),
                 "Gemma's post-sublayer norms, embedding scale, score scale, soft-capping or per-layer attention"),
                (model.sliding_window is not None, f"sliding-window attention ({model.sliding_window})"),
                (model.tie_embeddings, "a tied output embedding (tie_embeddings)"))
    for wrong, what in problems:
        if wrong:
            raise CheckpointError(f"torchtitan's Llama has no place for {what}. Fix: convert a dense Llama-family model "
                                  "without it (the DCP format carries torchtitan's Llama names)")


def torchtitan_mapping(model: ModelConfig) -> Mapping:
    """Our parameter names -> torchtitan's Llama names (export direction)."""
    refuse_untranslatable(model)
    layer = "layers.{layer}."
    qkv_rows = (model.heads_per_group * model.head_dim, model.head_dim, model.head_dim)
    half = model.head_dim // 2
    rules = [Rename("tok_embeddings.weight", "tok_embeddings.weight"),
             Rename(layer + "attention_norm.weight", layer + "attention_norm.weight"),
             SplitRows(layer + "attention.qkv.weight", tuple(layer + f"attention.w{p}.weight" for p in "qkv"), qkv_rows,
                       model.n_kv_heads),
             RegroupRows(layer + "attention.wq.weight", model.n_heads, 2, half),
             RegroupRows(layer + "attention.wk.weight", model.n_kv_heads, 2, half),
             Rename(layer + "attention.wo.weight", layer + "attention.wo.weight"),
             Rename(layer + "ffn_norm.weight", layer + "ffn_norm.weight"),
             SplitRows(layer + "feed_forward.gate_up.weight", (layer + "feed_forward.w1.weight", layer + "feed_forward.w3.weight"),
                       (1, 1), model.ffn_dim),
             Rename(layer + "feed_forward.down.weight", layer + "feed_forward.w2.weight"),
             Rename("norm.weight", "norm.weight"),
             Rename("output.weight", "output.weight")]
    return Mapping(tuple(rules))


def state_key(name: str, kind: str, optimizer_prefix: str = OPTIMIZER_PREFIXES[0]) -> str:
    """The flat DCP key torchtitan saves a parameter's weight or AdamW moment under."""
    if kind == PARAM:
        return name
    return f"{optimizer_prefix}state.{name}.{MOMENT_NAMES[kind]}"


def step_key(name: str, optimizer_prefix: str = OPTIMIZER_PREFIXES[0]) -> str:
    return f"{optimizer_prefix}state.{name}.{STEP}"


def param_group_key(name: str, setting: str, optimizer_prefix: str = OPTIMIZER_PREFIXES[0]) -> str:
    return f"{optimizer_prefix}param_groups.{name}.{setting}"


def classify_key(key: str, names: set[str]) -> tuple[str, str, str] | None:
    """(torchtitan name, kind or STEP, the prefix it was found under) of a DCP tensor key that holds
    a parameter's weight, AdamW moment or step, given the parameter names; None otherwise."""
    for prefix in OPTIMIZER_PREFIXES:
        if key.startswith(prefix + "state."):
            rest = key[len(prefix) + len("state."):]
            for kind, state in (*MOMENT_NAMES.items(), (STEP, STEP)):
                if rest.endswith("." + state) and rest[:-len(state) - 1] in names:
                    return rest[:-len(state) - 1], kind, prefix
    for prefix in MODEL_PREFIXES:
        if key.startswith(prefix) and key[len(prefix):] in names:
            return key[len(prefix):], PARAM, prefix
    return None


def is_auxiliary(key: str) -> bool:
    """State that is not the model's weights or AdamW moments (skipped by an import, by name)."""
    bare = key.removeprefix("model.")
    return key.startswith(AUXILIARY_PREFIXES) or bare in DERIVED_BUFFERS
