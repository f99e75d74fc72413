"""A model's parallelize plan as data, and what a checkpoint records of a user's model.

A user brings single-device code (`--model-factory package.module:function`, `examples/`); the
factory returns the module and a `ModelPlan`: which modules tensor parallelism splits and how
(module-name patterns -> style names of `plans/training/tp_plan.py`), what sequence parallelism
adds, which ModuleDict holds the blocks (the unit of FSDP, activation checkpointing and pipeline
cuts) and which modules run before and after them (the first and the last pipeline stage).

The driver builds the factory's module on the meta device once and records a `UserModel`: the
factory path, the plan, and every parameter's global shape and tp split dimension. Planners
(resharding, layout checks, offline tools) read that record from checkpoint metadata and never
import the user's code; only the ranks do, to build their shards.

Pure: no torch modules here, only names and shapes.
"""
from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass, field

from rayshard.plans.transforms.codec import canonical, decode_mapping
from rayshard.plans.transforms.mapping import Meta
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.plans.training.tp_plan import ALL_STYLES, split_dim_under

CROSS_ENTROPY = "cross_entropy"  # the built-in criterion: vocab-parallel under tp (`loss_parallel`)


def _pairs(mapping) -> tuple[tuple[str, str], ...]:
    items = mapping.items() if isinstance(mapping, dict) else mapping
    return tuple((str(pattern), str(style)) for pattern, style in items)


@dataclass(frozen=True)
class ModelPlan:
    """tp_styles: module-name pattern (fnmatch, global names) -> style name; dicts are accepted
    and kept as ordered pairs (the record is hashable and the first matching pattern wins).
    sequence_parallel: what `--sp` adds to the tp plan (norms, gathers); the tp styles take their
    sequence-sharded forms by themselves (`tp_plan.with_sequence_parallel`).
    blocks: the attribute holding an nn.ModuleDict of blocks keyed by global index "0".."n-1".
    first_stage / last_stage: modules only the first / last pipeline stage runs; the stage that
    lacks one finds it set to None, and the model's forward must then skip it (torchtitan's
    convention): without the first stage's modules it takes the residual stream, without the
    last stage's it returns it.
    hidden_size: the width of the residual stream pipeline stages exchange.
    loss: the criterion's name (the built-in "cross_entropy", or the user function's path).
    hf_mapping: optional, how `ckpt export` names the parameters for Hugging Face: transform rules
    as data (`plans/transforms/codec.py`), written once in the export direction.
    hf_config: the config.json to write beside them (`architectures` included; export adds the
    dtype). Both or neither: None refuses export. Neither takes part in the hash (dicts do not
    hash); equality still compares them."""

    tp_styles: tuple[tuple[str, str], ...] = ()
    blocks: str = "layers"
    first_stage: tuple[str, ...] = ()
    last_stage: tuple[str, ...] = ()
    sequence_parallel: tuple[tuple[str, str], ...] = ()
    hidden_size: int = 0
    vocab_size: int = 0
    max_seq_len: int = 0
    loss: str = CROSS_ENTROPY
    hf_mapping: tuple[dict, ...] | None = field(default=None, hash=False)
    hf_config: dict | None = field(default=None, hash=False)
    # Parameter-name patterns (fnmatch) of weights tp leaves whole but whose forward sees only
    # the rank's heads (Qwen3's per-head q/k norms): each tp rank's gradient is a partial sum, and
    # the ranks add them after the backward (`actors/parallel/parallelize.sum_partial_gradients`).
    tp_partial_gradients: tuple[str, ...] = ()
    # LoRA (`--lora-targets`, plans/training/lora.py): names people use -> module-name patterns
    # (fnmatch, global names), e.g. {"q": "blocks.*.attn.q"}; --lora-targets takes these names or
    # patterns, and without the flag a LoRA run adapts every module named here.
    lora_targets: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "tp_partial_gradients", tuple(str(p) for p in self.tp_partial_gradients))
        if (self.hf_mapping is None) != (self.hf_config is None):
            raise ConfigError("model plan hf_mapping/hf_config", "only one given", "an export needs both the "
                              "tensor mapping and the config.json contents", "give both in the ModelPlan, or neither")
        if self.hf_mapping is not None:
            object.__setattr__(self, "hf_mapping", canonical(self.hf_mapping))
            object.__setattr__(self, "hf_config", _json_object(self.hf_config))
        object.__setattr__(self, "tp_styles", _pairs(self.tp_styles))
        object.__setattr__(self, "lora_targets", _pairs(self.lora_targets))
        object.__setattr__(self, "sequence_parallel", _pairs(self.sequence_parallel))
        object.__setattr__(self, "first_stage", tuple(self.first_stage))
        object.__setattr__(self, "last_stage", tuple(self.last_stage))

    @classmethod
    def from_dict(cls, data: dict) -> "ModelPlan":
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def _json_object(config) -> dict:
    """The config as JSON gives it back (lists for tuples), so a plan compares equal after metadata."""
    try:
        again = json.loads(json.dumps(config))
    except (TypeError, ValueError) as error:
        raise ConfigError("model plan hf_config", type(config).__name__, f"is not JSON ({error})",
                          "give config.json's contents as a dict of plain values") from None
    if not isinstance(again, dict) or not again.get("architectures"):
        raise ConfigError("model plan hf_config", config, "is not a dict naming its 'architectures'",
                          'give config.json\'s contents, e.g. {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", ...}')
    return again


@dataclass(frozen=True)
class UserModel:
    """What a checkpoint records of a model built by a user's factory: enough to plan with (the
    shapes and split dims) and to build it again on the ranks (the factory path)."""

    factory: str
    plan: ModelPlan
    # (global name, global shape, tp split dim or -1 for none), in module order.
    parameters: tuple[tuple[str, tuple[int, ...], int], ...] = field(default=())

    def __post_init__(self):
        if isinstance(self.plan, dict):
            object.__setattr__(self, "plan", ModelPlan.from_dict(self.plan))
        object.__setattr__(self, "parameters", tuple((str(n), tuple(int(s) for s in shape), int(split))
                                                      for n, shape, split in self.parameters))

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, shape, _ in self.parameters}

    def split_dim(self, name: str) -> int | None:
        for parameter, _, split in self.parameters:
            if parameter == name:
                return None if split < 0 else split
        return None

    @property
    def n_blocks(self) -> int:
        prefix = self.plan.blocks + "."
        return len({name[len(prefix):].split(".")[0] for name, _, _ in self.parameters if name.startswith(prefix)})

    def stage_of(self, name: str) -> str | int:
        return stage_part(self.plan, name)


def stage_part(plan: ModelPlan, name: str) -> str | int:
    """"first", "last", or the block index a parameter belongs to (its pipeline stage's part)."""
    if name.startswith("lora."):  # a LoRA adapter of a top-level module (`lora.lm_head.a`) goes with it
        name = name[len("lora."):]
    prefix = plan.blocks + "."
    if name.startswith(prefix):
        return int(name[len(prefix):].split(".")[0])
    if _under(name, plan.first_stage):
        return "first"
    if _under(name, plan.last_stage):
        return "last"
    raise ConfigError("model.plan", name, "is in no block and in neither first_stage nor last_stage",
                      "list the module holding it in the plan's first_stage or last_stage")


def _under(name: str, modules: tuple[str, ...]) -> bool:
    return any(name == module or name.startswith(module + ".") for module in modules)


def recorded_parameters(plan: ModelPlan, shapes: dict[str, tuple[int, ...]]
                        ) -> tuple[tuple[str, tuple[int, ...], int], ...]:
    """Each parameter with the dimension the plan's tp styles split (-1: copied on every tp rank)."""
    styles = plan.tp_styles
    out = []
    for name, shape in shapes.items():
        split = split_dim_under(name, styles)
        out.append((name, tuple(shape), -1 if split is None else split))
    return tuple(out)


def validate_plan(plan: ModelPlan, module_names: list[str], shapes: dict[str, tuple[int, ...]]) -> None:
    """Before any rank starts: every pattern names a module, every style is known, the blocks
    are a run of global indices, and every parameter belongs to a pipeline part."""
    for section, pairs in (("tp_styles", plan.tp_styles), ("sequence_parallel", plan.sequence_parallel)):
        for pattern, style in pairs:
            if style not in ALL_STYLES:
                raise ConfigError(f"model plan {section}[{pattern!r}]", style, f"is not a style; known: {sorted(ALL_STYLES)}",
                                  "use one of the known style names")
            if not fnmatch.filter(module_names, pattern):
                raise ConfigError(f"model plan {section}", pattern, "matches no module of the model",
                                  "fix the pattern (global module names such as 'blocks.*.attn.qkv') or drop it")
    if plan.blocks not in module_names:
        raise ConfigError("model plan blocks", plan.blocks, "is not a module of the model",
                          "name the nn.ModuleDict attribute holding the blocks")
    blocks = sorted({int(n.split(".")[1]) for n in module_names if n.startswith(plan.blocks + ".") and
                     n.split(".")[1].isdigit()})
    if not blocks or blocks != list(range(len(blocks))):
        raise ConfigError("model plan blocks", plan.blocks, f"holds keys {blocks}, not 0..n-1",
                          "key the blocks' ModuleDict by global index: str(i) for i in range(n_layers)")
    for name in plan.first_stage + plan.last_stage:
        if name not in module_names:
            raise ConfigError("model plan first_stage/last_stage", name, "is not a module of the model",
                              "name the modules that run before and after the blocks")
    for positive in ("hidden_size", "vocab_size", "max_seq_len"):
        if getattr(plan, positive) < 1:
            raise ConfigError(f"model plan {positive}", getattr(plan, positive), "must be positive",
                              f"set {positive} in the plan the factory returns")
    record = UserModel("check", plan, recorded_parameters(plan, shapes))
    for name in shapes:
        record.stage_of(name)
    if plan.hf_mapping is not None:  # names and shapes only: a mapping that misses a parameter fails now, not at export
        try:
            decode_mapping(plan.hf_mapping).plan({name: Meta(tuple(shape), "float32") for name, shape in shapes.items()})
        except CheckpointError as error:
            raise ConfigError("model plan hf_mapping", f"{len(plan.hf_mapping)} rules", f"does not fit the model: {error}",
                              "make the rules cover every parameter once, with the shapes the model has") from None

