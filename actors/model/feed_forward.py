"""The gated feed-forward of the dense layers (and of an MoE layer's shared expert): SwiGLU, or
Gemma's GeGLU (activation "gelu_tanh")."""
from __future__ import annotations

import torch
from torch import nn

from rayshard.actors.model.swiglu import GateUpSwiGLU


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, activation: str = "silu"):
        super().__init__()
        self.gate_up = GateUpSwiGLU(dim, hidden, activation)  # its output is activation(gate) * up
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate_up's rows interleave (gate_j, up_j), so a row shard holds whole hidden units
        # (actors/model/swiglu.py says how the two halves are computed, and why).
        return self.down(self.gate_up(x))
