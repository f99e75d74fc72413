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

import fnmatch
import re
from dataclasses import replace

from rayshard.plans.errors import ConfigError
from rayshard.plans.training.model_plan import ModelPlan, UserModel
from rayshard.plans.training.model_spec import GATED_MLPS, USER_FAMILY, ModelConfig
from rayshard.plans.training.parameter_roles import FROZEN, TRAINED, ParameterRoles
from rayshard.plans.training.tp_plan import COLWISE, LORA_COLWISE, LORA_ROWWISE, ROWWISE, module_style, split_dim_under

# The logical projections an adapter can target, as people name them, even where the base fuses them.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION_TARGETS = ("q", "k", "v", "o")
FEED_FORWARD_TARGETS = ("gate", "up", "down")
ROW_PARALLEL_TARGETS = ("o", "down")  # the base splits their input; the others' output


def feed_forward_path(model: ModelConfig | None, layer: int) -> str | None:
    """Where a layer's gate, up and down adapters live: its dense feed-forward, or in an MoE layer
    its shared expert (`feed_forward.shared`, a dense SwiGLU). Routed experts get none (decision
    140): None for an MoE layer without a shared expert."""
    if model is None or not model.is_moe_layer(layer):
        return "feed_forward"
    return "feed_forward.shared" if model.shared_expert_ffn_dim else None


def adapter_module(layer: int, target: str, model: ModelConfig | None = None) -> str:
    """The module holding a target's adapter: `layers.3.attention.lora.q`; an MoE layer's
    feed-forward ones under its shared expert, `layers.3.feed_forward.shared.lora.gate`."""
    part = "attention" if target in ATTENTION_TARGETS else feed_forward_path(model, layer)
    return f"layers.{layer}.{part}.lora.{target}"


def projection_dims(model: ModelConfig, layer: int | None = None) -> dict[str, tuple[int, int]]:
    """Each logical projection's (in, out) features (in `layer`, where an MoE layer's gate, up and
    down are its shared expert's)."""
    hd, dim, ffn = model.head_dim, model.dim, model.ffn_dim
    if layer is not None and model.is_moe_layer(layer):
        ffn = model.shared_expert_ffn_dim
    return {"q": (dim, model.n_heads * hd), "k": (dim, model.n_kv_heads * hd), "v": (dim, model.n_kv_heads * hd),
            "o": (model.n_heads * hd, dim), "gate": (dim, ffn), "up": (dim, ffn), "down": (ffn, dim)}


def adapted_layers(model: ModelConfig, target: str) -> list[int]:
    """The layers where `target` gets an adapter."""
    return [layer for layer in range(model.n_layers)
            if target in ATTENTION_TARGETS or feed_forward_path(model, layer) is not None]


def check_lora_fits(model: ModelConfig, lora) -> None:
    """What the model must meet for these adapters, each refusal in one line."""
    if not lora.enabled:
        return
    lora.validate(user_model=model.user is not None)
    if model.user is not None:
        user_adapted_modules(model, lora)  # each refusal in one line
        return
    for target in lora.target_list:
        if target in FEED_FORWARD_TARGETS and model.mlp not in GATED_MLPS:
            raise ConfigError("lora.targets", lora.targets, f"{target!r} adapts a gated feed-forward's projection, and "
                              f"this {model.family} model's feed-forward is {model.mlp} (up, activation, down: no "
                              "adapters for it yet)", "adapt q,k,v,o only")
        layers = adapted_layers(model, target)
        if not layers:
            raise ConfigError("lora.targets", lora.targets, f"{target!r} adapts nothing in {model.family}: its MoE layers "
                              "have no shared expert, and routed experts take no adapters", "adapt q,k,v,o only")
        features_in, features_out = min((projection_dims(model, layer)[target] for layer in layers), key=min)
        if lora.rank > min(features_in, features_out):
            raise ConfigError("lora.rank", lora.rank, f"exceeds target {target!r}'s dimension ({features_in} in, "
                              f"{features_out} out)", f"set --lora-rank {min(features_in, features_out)} or less, "
                              f"or leave {target} out of --lora-targets")


def adapter_shapes(model: ModelConfig, rank: int, targets: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Global name -> shape of every adapter tensor, layer by layer, in the model's module order."""
    if model.user is not None:
        return {f"{user_adapter_module(module)}.{ab}": shape
                for module, (features_in, features_out) in user_target_modules(model, targets).items()
                for ab, shape in (("a", (rank, features_in)), ("b", (features_out, rank)))}
    shapes = {}
    for layer in range(model.n_layers):
        dims = projection_dims(model, layer)
        for target in (*ATTENTION_TARGETS, *FEED_FORWARD_TARGETS):
            if target in targets and (target in ATTENTION_TARGETS or feed_forward_path(model, layer)):
                features_in, features_out = dims[target]
                module = adapter_module(layer, target, model)
                shapes[module + ".a"] = (rank, features_in)
                shapes[module + ".b"] = (features_out, rank)
    return shapes


def recorded_adapter_shapes(model: ModelConfig, record: dict) -> dict[str, tuple[int, ...]]:
    """The adapters a LoRA checkpoint holds, from its manifest's `lora` metadata (the run's settings)."""
    targets = tuple(t.strip() for t in str(record["targets"]).split(",") if t.strip())
    return adapter_shapes(model, int(record["rank"]), targets)


def lora_tp_styles(lora) -> tuple[tuple[str, str], ...]:
    """The adapters' tp styles, added to the model plan's (an MoE layer's shared expert splits as a
    dense feed-forward does; a pattern that matches no module places nothing)."""
    parts = {t: ("attention",) if t in ATTENTION_TARGETS else ("feed_forward", "feed_forward.shared")
             for t in lora.target_list}
    return tuple((f"layers.*.{part}.lora.{t}", LORA_ROWWISE if t in ROW_PARALLEL_TARGETS else LORA_COLWISE)
                 for t in lora.target_list for part in parts[t])


def lora_roles(model: ModelConfig, lora, base: ParameterRoles) -> ParameterRoles:
    """The base frozen (read from the base, never stored by the run), every adapter trained and
    stored, after the base's parameters."""
    check_lora_fits(model, lora)
    frozen = tuple((name, shape, FROZEN) for name, shape, _ in base.parameters)
    adapters = adapter_shapes(model, lora.rank, lora.target_list)
    return ParameterRoles(frozen + tuple((name, shape, TRAINED) for name, shape in adapters.items()))


# ---- users' own models (`--model-factory`): targets by module-name pattern -----------------------

def user_adapter_module(module: str) -> str:
    """A user model's adapter beside its base module, as the built-in ones are: `blocks.0.attn.q`
    gets `blocks.0.attn.lora.q` (a child of the base Linear would be renamed by torch's tp styles)."""
    parent, _, child = module.rpartition(".")
    return f"{parent}.lora.{child}" if parent else f"lora.{child}"


def user_linear_modules(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """A user model's modules with a 2-D `weight` (its Linears), as (in, out) features, in module
    order; the plan's first-stage modules (the embeddings, whose 2-D weight is a table) left out."""
    embeddings = set(model.user.plan.first_stage)
    return {name[: -len(".weight")]: (shape[1], shape[0]) for name, shape in model.user.shapes.items()
            if name.endswith(".weight") and len(shape) == 2 and name[: -len(".weight")] not in embeddings}


def _pattern_of(model: ModelConfig, target: str) -> str:
    """A target of a user model: a name its plan's `lora_targets` gives a pattern, or a pattern."""
    return dict(model.user.plan.lora_targets).get(target, target)


def user_targets(model: ModelConfig, targets: tuple[str, ...]) -> tuple[str, ...]:
    """A user model's targets: as given, or, where they are the built-in default (no
    --lora-targets), every name the plan's `lora_targets` declares (none declared: the default
    names stay, and are refused as matching nothing)."""
    declared = tuple(name for name, _ in model.user.plan.lora_targets)
    return declared if declared and targets == LORA_TARGETS else targets


def user_target_modules(model: ModelConfig, targets) -> dict[str, tuple[int, int]]:
    """A user model's modules the targets (names or patterns) match, (in, out) features each."""
    linears = user_linear_modules(model)
    patterns = [_pattern_of(model, target) for target in user_targets(model, tuple(targets))]
    return {name: dims for name, dims in linears.items() if any(fnmatch.fnmatchcase(name, p) for p in patterns)}


def _module_families(names) -> list[str]:
    """Module names with their block index as `*` (`blocks.*.attn.q`), each once, in order."""
    return list(dict.fromkeys(re.sub(r"\.\d+\.", ".*.", name) for name in names))


def user_adapted_modules(model: ModelConfig, lora) -> dict[str, tuple[int, int]]:
    """The user model's modules the targets adapt, (in, out) each; refused in one line: a pattern
    that matches no Linear (naming those that exist), a rank above a module's dimension, a module
    under tp (not supported yet: its hooks would see torch's DTensors)."""
    linears = user_linear_modules(model)
    for target in user_targets(model, lora.target_list):
        pattern = _pattern_of(model, target)
        if not any(fnmatch.fnmatchcase(name, pattern) for name in linears):
            families = _module_families(linears)
            raise ConfigError("lora.targets", target, f"matches no module of the model; its Linear modules are "
                              f"{', '.join(families)}", "give module-name patterns from that list, e.g. "
                              f"--lora-targets '{families[0] if families else 'name'}'")
    adapted = user_target_modules(model, lora.target_list)
    for module, (features_in, features_out) in adapted.items():
        if lora.rank > min(features_in, features_out):
            raise ConfigError("lora.rank", lora.rank, f"exceeds module {module!r}'s dimension ({features_in} in, "
                              f"{features_out} out)", f"set --lora-rank {min(features_in, features_out)} or less")
    return adapted


def user_adapter_tp_styles(model: ModelConfig, targets: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """The tp styles of a user model's adapters: beside a column-parallel Linear B splits as its
    output, beside a row-parallel one A as its input (decision 124); beside an unsplit Linear
    both are copied. Other styles (a vocab-parallel head) take no adapter under tp
    (`check_user_lora_under_tp`)."""
    styles = dict(model.user.plan.tp_styles)
    adapter_styles = {COLWISE: LORA_COLWISE, ROWWISE: LORA_ROWWISE}
    return tuple((user_adapter_module(module), adapter_styles[style]) for module in user_target_modules(model, targets)
                 if (style := module_style(module, styles)) in adapter_styles)


def check_user_lora_under_tp(model: ModelConfig, lora) -> None:
    """Under tp a user model's adapter sits beside a column- or row-parallel Linear, or one tp
    leaves whole; beside any other style (the vocab-parallel head) it is refused in one line."""
    styles = dict(model.user.plan.tp_styles)
    for module in user_target_modules(model, lora.target_list):
        style = module_style(module, styles)
        if style not in (None, COLWISE, ROWWISE):
            raise ConfigError("lora.targets", lora.targets, f"adapts {module}, which tp splits as {style!r}: an adapter "
                              "can sit only beside a column- or row-parallel Linear, or one tp leaves whole",
                              f"leave {module} out of --lora-targets, or train without --tp")


# ---- offline planners on adapter checkpoints ---------------------------------------------------

def adapter_planning_model(model: ModelConfig, record: dict) -> ModelConfig:
    """The model as the offline planners (`ckpt reshard`, `ckpt plan`) see a LoRA checkpoint (its
    manifest's `lora` record): the adapters as its only parameters, each with its tp split, cut
    into pipeline stages as the base's blocks are. Written as a user-model record of the adapters,
    so regions, stage cuts and writers read it as they read any model (decision 140)."""
    targets = tuple(t.strip() for t in str(record["targets"]).split(",") if t.strip())
    shapes = adapter_shapes(model, int(record["rank"]), targets)
    base_plan = model.plan
    styles = user_adapter_tp_styles(model, targets) if model.user is not None else tuple(
        (f"layers.*.{part}.lora.{t}", LORA_ROWWISE if t in ROW_PARALLEL_TARGETS else LORA_COLWISE)
        for t in targets for part in (("attention",) if t in ATTENTION_TARGETS else ("feed_forward", "feed_forward.shared")))
    plan = ModelPlan(tp_styles=styles, blocks=base_plan.blocks, first_stage=base_plan.first_stage,
                     last_stage=base_plan.last_stage, hidden_size=base_plan.hidden_size or model.dim,
                     vocab_size=base_plan.vocab_size or model.vocab_size, max_seq_len=base_plan.max_seq_len or model.max_seq_len)
    splits = tuple((name, shape, -1 if (dim := split_dim_under(name, styles)) is None else dim)
                   for name, shape in shapes.items())
    user = UserModel(factory=f"the LoRA adapters of a {model.family} model", plan=plan, parameters=splits)
    return replace(model, family=USER_FAMILY, user=user, tie_embeddings=False)
