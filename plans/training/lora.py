"""LoRA on the built-in decoder, as data: which adapters exist, their shapes, roles and tp split.

Targets are the logical projections (q, k, v, o, gate, up, down) even where the base fuses them
(attention.qkv, feed_forward.gate_up, `plans/training/model_spec.py`): each gets its own A [r, in]
and B [out, r], named `layers.N.attention.lora.q.a` / `.b` (feed-forward ones under
`layers.N.feed_forward.lora`). The rank adds (alpha / r) * B (A x) to that projection's own
output slice (`actors/model/lora.py`), so an adapter on a fused weight acts exactly as separate
q/k/v (gate/up) adapters do, and the stored tensors are the ones PEFT names per projection.

Under tensor parallelism no full-size weight is gathered: for a column-parallel base (q, k, v,
gate, up) B is split like the base's output rows and A is copied; for a row-parallel base (o, down)
A is split like the base's input columns and B is copied (`tp_plan.LORA_COLWISE/ROWWISE`).

`lora` below is the run's settings, `plans/config/lora.py`'s LoraConfig (the config imports this
module, not the other way round).
"""
from __future__ import annotations

from rayshard.plans.errors import ConfigError
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.plans.training.parameter_roles import FROZEN, TRAINED, ParameterRoles
from rayshard.plans.training.tp_plan import LORA_COLWISE, LORA_ROWWISE

# The logical projections an adapter can target, as people name them, even where the base fuses them.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION_TARGETS = ("q", "k", "v", "o")
FEED_FORWARD_TARGETS = ("gate", "up", "down")
ROW_PARALLEL_TARGETS = ("o", "down")  # the base splits their input; the others' output


def adapter_module(layer: int, target: str) -> str:
    """The module holding a target's adapter: `layers.3.attention.lora.q`."""
    part = "attention" if target in ATTENTION_TARGETS else "feed_forward"
    return f"layers.{layer}.{part}.lora.{target}"


def projection_dims(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each logical projection's (in, out) features."""
    hd, dim, ffn = model.head_dim, model.dim, model.ffn_dim
    return {"q": (dim, model.n_heads * hd), "k": (dim, model.n_kv_heads * hd), "v": (dim, model.n_kv_heads * hd),
            "o": (model.n_heads * hd, dim), "gate": (dim, ffn), "up": (dim, ffn), "down": (ffn, dim)}


def check_lora_fits(model: ModelConfig, lora) -> None:
    """What the model must meet for these adapters, each refusal in one line."""
    if not lora.enabled:
        return
    lora.validate()
    if model.user is not None:
        raise ConfigError("lora", f"rank {lora.rank}", "adapters on a user's model (--model-factory) are not supported yet",
                          "train the user's model without --lora-rank, or use a built-in family")
    if model.is_moe:
        raise ConfigError("lora", f"rank {lora.rank}", f"adapters on mixture-of-experts models ({model.family}) are not "
                          "supported yet", "use a dense family, or train without --lora-rank")
    dims = projection_dims(model)
    for target in lora.target_list:
        features_in, features_out = dims[target]
        if lora.rank > min(features_in, features_out):
            raise ConfigError("lora.rank", lora.rank, f"exceeds target {target!r}'s dimension ({features_in} in, "
                              f"{features_out} out)", f"set --lora-rank {min(features_in, features_out)} or less, "
                              f"or leave {target} out of --lora-targets")


def adapter_shapes(model: ModelConfig, rank: int, targets: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Global name -> shape of every adapter tensor, layer by layer, in the model's module order."""
    dims, shapes = projection_dims(model), {}
    for layer in range(model.n_layers):
        for target in (*ATTENTION_TARGETS, *FEED_FORWARD_TARGETS):
            if target in targets:
                features_in, features_out = dims[target]
                module = adapter_module(layer, target)
                shapes[module + ".a"] = (rank, features_in)
                shapes[module + ".b"] = (features_out, rank)
    return shapes


def recorded_adapter_shapes(model: ModelConfig, record: dict) -> dict[str, tuple[int, ...]]:
    """The adapters a LoRA checkpoint holds, from its manifest's `lora` metadata (the run's settings)."""
    targets = tuple(t.strip() for t in str(record["targets"]).split(",") if t.strip())
    return adapter_shapes(model, int(record["rank"]), targets)


def lora_tp_styles(lora) -> tuple[tuple[str, str], ...]:
    """The adapters' tp styles, added to the model plan's."""
    return tuple((f"layers.*.{'attention' if t in ATTENTION_TARGETS else 'feed_forward'}.lora.{t}",
                  LORA_ROWWISE if t in ROW_PARALLEL_TARGETS else LORA_COLWISE) for t in lora.target_list)


def lora_roles(model: ModelConfig, lora, base: ParameterRoles) -> ParameterRoles:
    """The base frozen (read from the base, never stored by the run), every adapter trained and
    stored, after the base's parameters."""
    check_lora_fits(model, lora)
    frozen = tuple((name, shape, FROZEN) for name, shape, _ in base.parameters)
    adapters = adapter_shapes(model, lora.rank, lora.target_list)
    return ParameterRoles(frozen + tuple((name, shape, TRAINED) for name, shape in adapters.items()))
