"""What a rank holds of the training state: every parameter and AdamW moment as a piece of a
global tensor, with where it sits and along which mesh dims other ranks hold the same copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from actors.model import shards
from plans.checkpoint.chunks import EXP_AVG, EXP_AVG_SQ, PARAM
from plans.layout.parallel_layout import ParallelLayout, RankCoords

MOMENTS = (EXP_AVG, EXP_AVG_SQ)
DATA_DIMS = ("dp", "fsdp", "tp")


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """(global name, kind, tensor) for every piece of training state: params and AdamW moments."""
    for name, param in model.named_parameters():
        yield name, PARAM, param
        state = optimizer.state.get(param, {})
        for kind in MOMENTS:
            if kind in state:
                yield name, kind, state[kind]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (what `to_local()` returns a view of). `to_local()` runs an
    autograd Function, ~28 us a call: a tenth of a small local load went to the ~150 calls."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def rank_layout(model: torch.nn.Module) -> tuple[ParallelLayout, RankCoords]:
    """This rank's layout and coordinates, read off the DTensor meshes and the process group
    (degrees no mesh shows are 1: FSDP and TP turn every parameter they touch into a DTensor)."""
    sizes = {dim: 1 for dim in DATA_DIMS}
    for param in model.parameters():
        if isinstance(param, DTensor):
            for dim, size in zip(param.device_mesh.mesh_dim_names or (), param.device_mesh.shape):
                if dim in sizes:
                    sizes[dim] = size
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = ParallelLayout(pp=max(1, world // (sizes["dp"] * sizes["fsdp"] * sizes["tp"])), **sizes)
    return layout, layout.coords_of(rank)


def replicated_dims(tensor: torch.Tensor, layout: ParallelLayout) -> tuple[str, ...]:
    """Mesh dims along which other ranks hold an identical copy of this rank's piece: the tensor's
    Replicate dims, and every data/tensor-parallel dim its mesh does not cover (a norm weight under
    TP without FSDP is a plain tensor copied on every tp rank)."""
    covered, copies = set(), set()
    if isinstance(tensor, DTensor):
        for dim, placement in zip(tensor.device_mesh.mesh_dim_names, tensor.placements):
            covered.add(dim)
            if isinstance(placement, Replicate):
                copies.add(dim)
    copies |= {dim for dim in DATA_DIMS if dim not in covered}
    return tuple(dim for dim in ("pp", *DATA_DIMS) if dim in copies and getattr(layout, dim) > 1)


def ties_embeddings(model) -> bool:
    if hasattr(model, "tie_embeddings"):  # the pipeline's view of a rank's stages
        return bool(model.tie_embeddings)
    return bool(getattr(getattr(model, "config", None), "tie_embeddings", False))


def is_pipeline_copy(tensor: torch.Tensor) -> bool:
    """The trainer marks the last stage's copy of a tied embedding (and its moments)."""
    mark = getattr(shards, "PIPELINE_COPY", None)
    return bool(mark and getattr(tensor, mark, False))
