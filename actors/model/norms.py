"""LayerNorm with a bias (GPT-2's) and Gemma's (1 + weight) RMSNorm, the decoder's other norms
beside RMSNorm (`ModelConfig.norm`).

A plain function of local tensors run through `local_map` (`actors/model/local_ops.py`), as
RMSNorm is, so under sequence parallelism it computes on the rank's sequence shard, and the
gradients of its weight and bias, partial sums over that shard's tokens, are declared Partial
for DTensor to add.
"""
from __future__ import annotations

import torch
from torch import nn

from rayshard.actors.model.local_ops import layer_norm, rms_norm_plus_one


class LayerNorm(nn.Module):
    """nn.LayerNorm's parameters and result (weight ones, bias zeros), through `layer_norm`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)


class RMSNormPlusOne(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), in float32 (`rms_norm_plus_one`). Its weight
    starts at zeros (the identity scale), as transformers starts it and stores it: an import or
    export moves the weight as it is."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_plus_one(x, self.weight, self.eps)
