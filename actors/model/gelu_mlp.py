"""GPT-2's feed-forward: up (dim -> hidden), GELU, down (hidden -> dim), each with an optional bias.

No gate, so no fused tensor: `up` is an ordinary column-parallel Linear under tensor parallelism
(its rows and its bias split by hidden unit) and `down` row-parallel (its bias added once, after
the tp reduction: torch's RowwiseParallel keeps it whole). The activation runs on the rank's own
hidden units. "gelu_tanh" is the tanh approximation GPT-2 trained with (transformers'
`gelu_new`), "gelu" the exact erf form.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

APPROXIMATION = {"gelu_tanh": "tanh", "gelu": "none"}


class GeluFeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int, kind: str, bias: bool):
        super().__init__()
        self.approximate = APPROXIMATION[kind]
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate=self.approximate))
