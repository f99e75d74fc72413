"""RoPE's inverse frequencies, plain or scaled, and the factor cos and sin are multiplied by.

Each scaled type follows transformers' function of the same name in `modeling_rope_utils.py`
(`_compute_linear_scaling_rope_parameters`, `_compute_dynamic_ntk_parameters`,
`_compute_yarn_parameters`, `_compute_llama3_parameters`) step by step, in float64 where
transformers computes in float32, so every rank and layout gets the same tables and they sit
within float32 rounding of transformers' (tests/unit/test_rope_scaling.py compares them).
The record of what to compute is `plans/training/rope_scaling.py`.
"""
from __future__ import annotations

import math

import torch

from rayshard.plans.training.rope_scaling import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None, seq_len: int,
                        max_seq_len: int) -> tuple[torch.Tensor, float]:
    """[head_dim / 2] float64 inverse frequencies and the attention factor (1.0 but for yarn).
    seq_len: the forward's sequence length (only `dynamic` reads it); max_seq_len: the model's
    max_position_embeddings (dynamic's threshold, yarn's factor when none is given)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    plain = 1.0 / (theta ** exponents)
    if scaling is None:
        return plain, 1.0
    kind = scaling.rope_type
    if kind == "linear":
        return plain / scaling.factor, 1.0
    if kind == "dynamic":
        return _dynamic(head_dim, theta, scaling.factor, seq_len, max_seq_len, exponents), 1.0
    if kind == "llama3":
        return _llama3(plain, scaling), 1.0
    if kind == "yarn":
        return _yarn(head_dim, theta, scaling, max_seq_len, exponents)
    raise ValueError(f"rope_type {kind!r} has no frequencies here; RopeScaling.validate names the known ones")


def _dynamic(head_dim, theta, factor, seq_len, max_seq_len, exponents) -> torch.Tensor:
    # NTK-aware: the base grows once the sequence is longer than max_position_embeddings.
    length = max(seq_len, max_seq_len)
    base = theta * ((factor * length / max_seq_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** exponents)


def _llama3(plain: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / plain
    # Long wavelengths (low frequencies) are divided by factor, short ones kept, the ones between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, plain / factor, plain)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim, theta, scaling: RopeScaling, max_seq_len, exponents) -> tuple[torch.Tensor, float]:
    factor = scaling.yarn_factor(max_seq_len)
    original = scaling.original_max_position_embeddings
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        if scaling.mscale and scaling.mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, scaling.mscale) / _yarn_mscale(factor, scaling.mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.beta_fast or 32, scaling.beta_slow or 1  # transformers' `or`: 0 means the default

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate is None or scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low), 0, 1)
    position_frequencies = theta ** exponents
    extrapolation, interpolation = 1.0 / position_frequencies, 1.0 / (factor * position_frequencies)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight, float(attention_factor)
