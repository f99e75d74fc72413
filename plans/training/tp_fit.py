"""Which tensor-parallel degrees a model can be split by, from every constraint at once.

tp cuts attention by kv-head groups (so query heads too), the feed-forward's hidden units, each
expert's and the shared expert's, and the vocabulary (embedding, LM head and loss); a user's
model, each parameter its plan splits, along its recorded dimension. A degree fits when it
divides every one of those sizes, and whatever else the run adds (a world size, the sequence
under sequence parallelism). A refusal names the first size the degree does not divide, and its
fix lists only degrees that divide them all: a hint that names a degree the next check refuses
(vocabulary 1001 suggesting tp 7 with 2 kv heads) sends a person round in circles.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.training.model_spec import ModelConfig


@dataclass(frozen=True)
class TpSplit:
    """One size tp must divide. problem: the refusal's words; alternative: a second way out that
    the fix adds after the degrees (a user's plan may leave the module unsplit)."""

    size: int
    problem: str
    alternative: str = ""


def tp_splits(model: ModelConfig, vocabulary: bool = True, vocabulary_fix: bool = False) -> tuple[TpSplit, ...]:
    """Every size of `model` that tp splits (the vocabulary's left out with vocabulary=False;
    vocabulary_fix: its refusal offers --vocab-size as a second way out)."""
    if model.user is not None:
        return tuple(TpSplit(shape[split] if split < len(shape) else 1,
                             f"cannot split parameter {name} of shape {list(shape)} along dim {split}",
                             ", or leave its module out of the plan's tp_styles")
                     for name, shape, split in model.user.parameters if split >= 0)
    splits = [TpSplit(model.n_kv_heads, f"must divide the number of kv heads ({model.n_kv_heads})"),
              TpSplit(model.ffn_dim, f"must divide model.ffn_dim ({model.ffn_dim})")]
    if vocabulary:
        splits.append(TpSplit(model.vocab_size, f"must divide model.vocab_size ({model.vocab_size}) for the "
                                                "vocab-parallel embedding",
                              ", or a --vocab-size that tp divides" if vocabulary_fix else ""))
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
                  also: tuple[TpSplit, ...] = (), training: bool = True) -> None:
    """Refuse a tp that does not divide some size of the model, the fix listing every degree that
    fits all of them and `also` (the run's own limits, which their own checks refuse, naming
    their own fields). training: a run may still choose its vocabulary (an offline reshard of a
    checkpoint may not), so its fix offers that too."""
    for split in tp_splits(model, vocabulary_fix=training):
        if split.size % tp:
            raise ConfigError(field, tp, split.problem, f"use {flag} in {fitting_tp(model, also)}{split.alternative}")


def vocab_multiple(model: ModelConfig) -> int:
    """What a built-in model's vocabulary is rounded up to so that it never limits tp: the greatest
    common divisor of the other sizes tp splits (every degree they allow divides it)."""
    return math.gcd(*(split.size for split in tp_splits(model, vocabulary=False)))
