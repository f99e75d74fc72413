"""Rotary position embedding with a hand-written backward.

The backward of a rotation is the rotation's transpose, which needs only cos and sin: the
autograd version would keep the rotated input alive for the backward, this one keeps nothing
per activation. Convention is "rotate half" (first half of head_dim pairs with the second half),
the same as Hugging Face Llama, so weights export without a permutation.

cos and sin are [seq, head_dim] and the two halves are not assumed to be equal: the backward
handles general values, and the test feeds halves that differ (a backward that silently assumed
equal halves once passed a symmetric test). RoPE scaling (Llama 3's, yarn's, ...) changes only the
tables; yarn's attention factor scales cos and sin, which the backward takes as they are.
"""
from __future__ import annotations

import torch

from rayshard.actors.model.rope_frequencies import inverse_frequencies
from rayshard.plans.training.rope_scaling import RopeScaling


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None, scaling: RopeScaling | None = None,
                max_seq_len: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq_len, head_dim], computed in float64 then cast, so every layout
    (and every rank) gets bit-identical tables. scaling: the model's RoPE scaling (its
    frequencies, and yarn's attention factor on cos and sin: `rope_frequencies.py`); a `dynamic`
    one depends on seq_len, which is why the tables are made per forward. max_seq_len: the
    model's max_position_embeddings, which dynamic and yarn read."""
    inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling, seq_len, max_seq_len)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.float().to(device), sin.float().to(device)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _rotate_half_transposed(x: torch.Tensor) -> torch.Tensor:
    # rotate_half is the linear map [a, b] -> [-b, a]; its transpose is [a, b] -> [b, -a].
    first, second = x.chunk(2, dim=-1)
    return torch.cat([second, -first], dim=-1)


class _ApplyRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return x * cos + _rotate_half(x) * sin

    @staticmethod
    def backward(ctx, grad_out):
        cos, sin = ctx.saved_tensors
        return grad_out * cos + _rotate_half_transposed(grad_out * sin), None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, seq, heads, head_dim]; cos, sin: [seq, head_dim]."""
    return _ApplyRope.apply(x, cos[:, None, :], sin[:, None, :])

