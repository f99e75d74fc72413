"""Which tensor-parallel degrees a model can be split by, from every constraint at once.

tp cuts attention by kv-head groups (so query heads too), the feed-forward's hidden units, each
expert's and the shared expert's; a user's model, each parameter its plan splits, along its
recorded dimension. A degree fits when it divides every one of those sizes, and whatever else the
run adds (a world size, the sequence under sequence parallelism). A refusal names the first size
the degree does not divide, and its fix lists only degrees that divide them all: a hint that names
a degree the next check refuses (vocabulary 1001 suggesting tp 7 with 2 kv heads) sends a person
round in circles.

The vocabulary is not one of them (docs/decisions.md 118): the vocab-parallel embedding, LM head
and loss shard it unevenly as torch.chunk cuts it (DTensor's Shard: the last ranks hold fewer
rows), so any tp splits any vocabulary, and a user plan's vocab-parallel modules likewise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.plans.training.tp_plan import VOCAB_STYLES, module_style


@dataclass(frozen=True)
class TpSplit:
    """One size tp must divide. problem: the refusal's words; alternative: a second way out that
    the fix adds after the degrees (a user's plan may leave the module unsplit)."""

    size: int
    problem: str
    alternative: str = ""


def tp_splits(model: ModelConfig) -> tuple[TpSplit, ...]:
    """Every size of `model` that tp must divide (not the vocabulary: module docstring)."""
    if model.user is not None:
        styles = dict(model.user.plan.tp_styles)
        return tuple(TpSplit(shape[split] if split < len(shape) else 1,
                             f"cannot split parameter {name} of shape {list(shape)} along dim {split}",
                             ", or leave its module out of the plan's tp_styles")
                     for name, shape, split in model.user.parameters
                     if split >= 0 and module_style(name.rpartition(".")[0], styles) not in VOCAB_STYLES)
    splits = [TpSplit(model.n_kv_heads, f"must divide the number of kv heads ({model.n_kv_heads})"),
              TpSplit(model.ffn_dim, f"must divide model.ffn_dim ({model.ffn_dim})")]
    if model.is_moe:
        splits.append(TpSplit(model.expert_ffn_dim, f"must divide model.expert_ffn_dim ({model.expert_ffn_dim})"))
        if model.shared_expert_ffn_dim:
            splits.append(TpSplit(model.shared_expert_ffn_dim,
                                  f"must divide model.shared_expert_ffn_dim ({model.shared_expert_ffn_dim})"))
    return tuple(splits)


def fitting_tp(model: ModelConfig, also: tuple[TpSplit, ...] = ()) -> list[int]:
    """The degrees that divide every size at once: the divisors of their greatest common divisor."""
    common = math.gcd(*(split.size for split in tp_splits(model) + tuple(also)))
    return [d for d in range(1, common + 1) if common % d == 0] if common else [1]


def check_tp_fits(model: ModelConfig, tp: int, field: str = "layout.tp", flag: str = "--tp",
                  also: tuple[TpSplit, ...] = ()) -> None:
    """Refuse a tp that does not divide some size of the model, the fix listing every degree that
    fits all of them and `also` (the run's own limits, which their own checks refuse, naming
    their own fields)."""
    for split in tp_splits(model):
        if split.size % tp:
            raise ConfigError(field, tp, split.problem, f"use {flag} in {fitting_tp(model, also)}{split.alternative}")


def vocab_multiple(model: ModelConfig) -> int:
    """What a built-in model's vocabulary taken from a tokenizer is rounded up to: the greatest
    common divisor of the sizes tp splits, so every degree they allow cuts it into equal shards
    (any vocabulary runs on any tp; equal shards spare the last ranks' idle rows)."""
    return math.gcd(*(split.size for split in tp_splits(model)))
