"""The SwiGLU feed-forward of the dense layers (and of an MoE layer's shared expert)."""
from __future__ import annotations

import torch
from torch import nn

from actors.model.swiglu import interleaved_swiglu


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Rows interleave (gate_j, up_j), so a row shard holds whole hidden units; the activation
        # works on the interleaved output as it is (actors/model/swiglu.py says how and why).
        return self.down(interleaved_swiglu(self.gate_up(x)))
