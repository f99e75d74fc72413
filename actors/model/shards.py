"""Where a rank's local tensor sits inside the global tensor.

The one fact both checkpointing and initialisation rest on: for a DTensor, DTensor's own
`compute_local_shape_and_global_offset` (it understands FSDP-over-TP strided sharding and
uneven chunks); for a plain tensor, the whole tensor.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

# DTensor's computation costs ~0.5 ms a call (it builds small tensors); a load or save asks for
# every parameter and moment several times, which on the small preset was half the load time.
# Remembered on the tensor object (it lives as long as the tensor), and checked against what the
# answer depends on, so a tensor whose placement or mesh changes is computed afresh.
_REGION = "_rayshard_local_region"


def local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local sizes) of this rank's piece."""
    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    mesh, depends_on = tensor.device_mesh, (tuple(tensor.shape), tuple(tensor.placements))
    remembered = getattr(tensor, _REGION, None)
    # The mesh is compared by identity, not id(): a copied or unpickled tensor carries the
    # attribute, and an id can be reused once its object is gone.
    if remembered is not None and remembered[0] is mesh and remembered[1] == depends_on:
        return remembered[2]
    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, mesh, tensor.placements)
    region = tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
    setattr(tensor, _REGION, (mesh, depends_on, region))
    return region


# Set (to True) on a tensor that is a pipeline copy of another rank's or stage's tensor: the
# last stage's copy of tied embeddings, and that copy's optimizer moments. The first stage holds
# the original; copies are never primary, so checkpoints write the tensor once and the gradient
# norm counts it once.
PIPELINE_COPY = "_rayshard_pipeline_copy"


def mark_pipeline_copy(tensor: torch.Tensor) -> None:
    setattr(tensor, PIPELINE_COPY, True)


def is_primary_replica(tensor: torch.Tensor, coords: dict[str, int]) -> bool:
    """True on exactly one rank among those holding identical copies of this piece.

    Copies sit along the tensor's Replicate mesh dims and along every data/tensor-parallel dim
    its mesh does not cover (a norm weight under FSDP lives on the (dp, fsdp) mesh but is also
    copied on every tp rank). The copy at coordinate 0 of all those dims is the primary.
    `coords` is this rank's position on the full mesh, e.g. {"dp": 1, "fsdp": 0, "tp": 1}.
    A tensor marked by `mark_pipeline_copy` is a copy along the pipeline and never primary.
    """
    if getattr(tensor, PIPELINE_COPY, False):
        return False
    covered: set[str] = set()
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        for name, coordinate, placement in zip(mesh.mesh_dim_names, mesh.get_coordinate(), tensor.placements):
            covered.add(name)
            if isinstance(placement, Replicate) and coordinate != 0:
                return False
    return all(coords[name] == 0 for name in ("dp", "fsdp", "tp") if name not in covered)
