"""Ops written for plain local tensors, run on sharded ones through torch's `local_map`.

`local_map` is how a function that knows nothing of DTensor (a fused kernel, a hand-written op)
runs on DTensor inputs: it states the placements it expects (redistributing inputs that differ),
the placements its outputs have, and the placements the inputs' gradients have. Called with
plain tensors it simply calls the function, so the model code stays single-device.

RMSNorm is the op where the model meets DTensor: under sequence parallelism the norm's input is
split over the sequence (Shard(1)) and its weight replicated. The weight's gradient computed on
one sequence shard is a partial sum over that shard's tokens: `in_grad_placements` says Partial,
so DTensor adds the tp ranks' parts; declaring it Replicate would silently keep one shard's.

Example, a user's op (any function of local tensors) on sequence shards:

    scaled = local_map(lambda x, scale: x * scale, out_placements=[Shard(1)],
                       in_placements=((Shard(1),), None), redistribute_inputs=True)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import local_map


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


# x split over the sequence, the weight replicated (SequenceParallel's layouts); eps is a number.
rms_norm = local_map(
    _rms_norm,
    out_placements=[Shard(1)],  # a list: the one output's placements (a tuple would mean one per output)
    in_placements=((Shard(1),), (Replicate(),), None),
    in_grad_placements=((Shard(1),), (Partial(),), None),
    redistribute_inputs=True,
)


def _rms_norm_plus_one(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Gemma's RMSNorm as transformers computes it, op for op: in float32 whatever x's dtype, the
    # weight an offset from 1 (so 1 + weight keeps a bf16 weight's small steps), the result cast
    # back to x's dtype.
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).type_as(x)


# Gemma's norm (ModelConfig.norm "rmsnorm_plus_one"), with rms_norm's placements.
rms_norm_plus_one = local_map(
    _rms_norm_plus_one,
    out_placements=[Shard(1)],
    in_placements=((Shard(1),), (Replicate(),), None),
    in_grad_placements=((Shard(1),), (Partial(),), None),
    redistribute_inputs=True,
)


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


# LayerNorm (GPT-2's): as rms_norm, with a bias that is replicated and whose gradient is partial too.
layer_norm = local_map(
    _layer_norm,
    out_placements=[Shard(1)],
    in_placements=((Shard(1),), (Replicate(),), (Replicate(),), None),
    in_grad_placements=((Shard(1),), (Partial(),), (Partial(),), None),
    redistribute_inputs=True,
)
