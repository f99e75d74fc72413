"""RoPE scaling: how a model stretches its rotary frequencies past the context it was trained on.

The four types transformers computes for the Llama-style families (`ROPE_INIT_FUNCTIONS` of its
`modeling_rope_utils.py`), under its names, so a config.json's `rope_parameters` (or 4.x's
`rope_scaling`) maps field by field:

- linear: every frequency divided by `factor` (positions interpolated).
- dynamic: NTK-aware: past `max_position_embeddings` the base grows with the sequence length L as
  theta * (factor * L / max - (factor - 1)) ** (d / (d - 2)). It depends on the forward's length,
  so the tables are computed per forward (as transformers does for a fresh model's forward over L).
- yarn: frequencies blended between interpolated and extrapolated by a ramp over the dimensions
  (beta_fast, beta_slow, truncate), and cos/sin multiplied by an attention factor (given, or from
  factor, mscale and mscale_all_dim) — Qwen2.5's long-context setting, DeepSeek's.
- llama3: low frequencies divided by `factor`, high ones kept, a smooth blend between
  (low_freq_factor, high_freq_factor, original_max_position_embeddings) — Llama 3.1, 3.2, 3.3.

The record holds only what the type reads; `actors/model/rope_frequencies.py` computes the
frequencies. Pure data and checks.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from rayshard.plans.errors import ConfigError

ROPE_TYPES = ("linear", "dynamic", "yarn", "llama3")
# The fields each type reads (transformers' `_validate_<type>_rope_parameters`), beyond rope_type.
FIELDS_OF = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"),
    "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
}
# Fields a type cannot do without (yarn's factor may be left out: max_seq_len / original then).
REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("original_max_position_embeddings",),
            "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor")}


@dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling, transformers' field names; unused fields stay None."""

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool | None = None

    @classmethod
    def from_dict(cls, data, where: str = "model.rope_scaling") -> "RopeScaling":
        """From a config file's or metadata's mapping; unknown keys are named."""
        if isinstance(data, RopeScaling):
            return data
        if not isinstance(data, dict):
            raise ConfigError(where, data, "must be a mapping such as {rope_type: llama3, factor: 8.0, ...}",
                              f"write it as a mapping with rope_type one of {list(ROPE_TYPES)} and its fields")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(where, unknown, f"unknown key(s) {unknown}", f"known keys are {sorted(known)}")
        if "rope_type" not in data:
            raise ConfigError(where, data, "has no rope_type", f"set rope_type to one of {list(ROPE_TYPES)}")
        return cls(**data)

    def to_dict(self) -> dict:
        """The fields that are set: what transformers' rope_parameters holds besides rope_theta."""
        return {key: value for key, value in asdict(self).items() if value is not None}

    def validate(self, max_seq_len: int, head_dim: int, where: str = "model.rope_scaling") -> "RopeScaling":
        """Each value one that the type's formula computes with; a one-line error otherwise."""
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"{where}.rope_type", self.rope_type, f"is not one of {list(ROPE_TYPES)}",
                              "use linear, dynamic, yarn or llama3 (or no rope_scaling for plain RoPE)")
        used = FIELDS_OF[self.rope_type]
        for name in (f.name for f in fields(self)):
            value = getattr(self, name)
            if name == "rope_type" or value is None:
                continue
            if name not in used:
                raise ConfigError(f"{where}.{name}", value, f"is not read by rope_type {self.rope_type!r}",
                                  f"remove it (that type reads {', '.join(used)})")
            _check_value(f"{where}.{name}", name, value)
        missing = [name for name in REQUIRED[self.rope_type] if getattr(self, name) is None]
        if missing:
            raise ConfigError(f"{where}.{missing[0]}", None, f"is required by rope_type {self.rope_type!r}",
                              f"set {', '.join(missing)}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(f"{where}.high_freq_factor", self.high_freq_factor,
                              f"must exceed low_freq_factor ({self.low_freq_factor}): the blend between them divides "
                              "by their difference", "use Llama 3's values, low_freq_factor 1.0 and high_freq_factor 4.0")
        if self.rope_type == "dynamic" and head_dim <= 2:
            raise ConfigError(f"{where}.rope_type", "dynamic", f"needs a head size above 2 (it is {head_dim}): the base "
                              "grows with the power d / (d - 2)", "use linear scaling, or a larger head size")
        if self.rope_type == "yarn" and self.factor is None and max_seq_len <= self.original_max_position_embeddings:
            raise ConfigError(f"{where}.factor", None, f"left out, it is max_seq_len / original_max_position_embeddings "
                              f"= {max_seq_len} / {self.original_max_position_embeddings}, which stretches nothing",
                              "set factor, or raise model.max_seq_len above original_max_position_embeddings")
        return self

    def yarn_factor(self, max_seq_len: int) -> float:
        """yarn's factor: given, or the context's stretch (transformers' DeepSeek-V3 rule)."""
        return self.factor if self.factor is not None else max_seq_len / self.original_max_position_embeddings


def _check_value(name: str, field: str, value) -> None:
    if field == "truncate":
        if not isinstance(value, bool):
            raise ConfigError(name, value, "must be true or false", "write truncate: true (the default) or false")
        return
    if field == "original_max_position_embeddings":
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(name, value, "must be a positive whole number (the context length trained on)",
                              "set it to the model's pre-scaling context, e.g. 8192 for Llama 3.1")
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ConfigError(name, value, "must be a finite number", f"set {field} to a number, or remove it")
    if field in ("factor", "low_freq_factor", "high_freq_factor") and value <= 0:
        raise ConfigError(name, value, "must be positive (frequencies are divided by it)",
                          "e.g. factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0 (Llama 3.1)")
    if field == "attention_factor" and value < 0:
        raise ConfigError(name, value, "must be 0 or more (cos and sin are multiplied by it)",
                          "remove it to take yarn's default from factor")


def longest_sequence(max_seq_len: int, scaling: RopeScaling | None) -> int:
    """The longest sequence a model trains on. `max_seq_len` is transformers'
    max_position_embeddings: the context it was trained to, except under `dynamic` scaling, where
    it is the *original* context and the base grows past it with the sequence (its whole point),
    up to `factor` times it. Every other type already states its extended context there."""
    if scaling is not None and scaling.rope_type == "dynamic" and scaling.factor:
        return int(max_seq_len * scaling.factor)
    return max_seq_len
