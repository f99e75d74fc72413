"""What a rank holds of the training state: every parameter and AdamW moment as a piece of a
global tensor, with where it sits and along which mesh dims other ranks hold the same copy.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from rayshard.actors.parallel.shards import NO_PIPELINE_COPIES, PipelineCopies, copy_dims
from rayshard.plans.checkpoint.chunks import EXP_AVG, EXP_AVG_SQ, PARAM
from rayshard.plans.layout.parallel_layout import STAGE_MESH_DIMS, ParallelLayout, RankCoords

MOMENTS = (EXP_AVG, EXP_AVG_SQ)


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  without: PipelineCopies = NO_PIPELINE_COPIES, only: frozenset[str] | None = None):
    """(global name, kind, tensor) for every piece of training state: params and AdamW moments
    (`without`: leave out these parameters and their moments; `only`: the names a checkpoint
    stores, `ParameterRoles.stored_names`, None for every parameter)."""
    for name, param in model.named_parameters():
        if param in without or (only is not None and name not in only):
            continue
        yield name, PARAM, param
        state = optimizer.state.get(param, {})
        for kind in MOMENTS:
            if kind in state:
                yield name, kind, state[kind]


def rank_layout(model: torch.nn.Module) -> tuple[ParallelLayout, RankCoords]:
    """This rank's layout and coordinates, read off the DTensor meshes and the process group
    (degrees no mesh shows are 1: FSDP and TP turn every parameter they touch into a DTensor)."""
    sizes = {dim: 1 for dim in STAGE_MESH_DIMS}
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
    """The mesh dims along which other ranks of this layout hold an identical copy of this rank's
    piece: its `copy_dims` whose degree is more than 1."""
    return tuple(dim for dim in copy_dims(tensor) if getattr(layout, dim) > 1)


def ties_embeddings(model) -> bool:
    if hasattr(model, "tie_embeddings"):  # the pipeline's view of a rank's stages
        return bool(model.tie_embeddings)
    return bool(getattr(getattr(model, "config", None), "tie_embeddings", False))
