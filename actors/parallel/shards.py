"""Where a rank's local tensor sits inside the global tensor.

The one fact both checkpointing and initialisation rest on: for a DTensor, DTensor's own
`compute_local_shape_and_global_offset` (it understands FSDP-over-TP strided sharding and
uneven chunks), except where FSDP2 cuts an uneven tp piece (`region_at`); for a plain tensor,
the whole tensor. And who else holds the same piece: the
mesh dims it is copied along (`copy_dims`), and the rank's pipeline copies of another stage's
parameters (`PipelineCopies`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from rayshard.plans.checkpoint.regions import chunk_bounds
from rayshard.plans.layout.parallel_layout import STAGE_MESH_DIMS

# DTensor's computation costs ~0.5 ms a call (it builds small tensors); a load or save asks for
# every parameter and moment several times, which on the small preset was half the load time.
# Remembered by what the answer depends on (global shape, placements, the mesh's shape and this
# rank's coordinate in it), not on the tensor object: `get_state_dict` wraps parameters and
# optimizer states in fresh DTensors at every call, so a memo on the object missed every save of
# rayshard.checkpoint. Nor on the mesh object: a key holds its mesh, the mesh its process groups,
# and a destroyed group's gloo threads and sockets live as long as anything holds it, so a reused
# rank kept every earlier run's groups alive (four loop threads per run at dp2 x tp2, each waking
# to poll; hundreds of them slowed every later run in the process, decision 233).
_REGIONS: dict[tuple, tuple[tuple[int, ...], tuple[int, ...]]] = {}
_REGIONS_KEPT = 8192


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard itself (what `to_local()` returns a view of). `to_local()` runs an
    autograd Function, ~28 us a call: a tenth of a small local load went to the ~150 calls."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def local_region(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local sizes) of this rank's piece."""
    if not isinstance(tensor, DTensor):
        return (0,) * tensor.dim(), tuple(tensor.shape)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    key = (tuple(tensor.shape), tuple(tensor.placements), tuple(mesh.shape),
           None if coordinate is None else tuple(coordinate))  # None: a rank outside the mesh holds nothing
    region = _REGIONS.get(key)
    if region is None:
        region = region_at(tuple(tensor.shape), tuple(mesh.shape), coordinate, tensor.placements)
        if len(_REGIONS) >= _REGIONS_KEPT:  # a process that builds model after model: start afresh
            _REGIONS.clear()
        _REGIONS[key] = region
    return region


def region_at(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int],
              placements: tuple[Placement, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global offsets, local sizes) of the piece at mesh `coordinate`.

    FSDP2 over tp places a weight tp splits by rows as (_StridedShard(0, tp) on fsdp, Shard(0)
    on tp) and holds torch.chunk of the tp rank's torch.chunk. Where tp does not divide the rows
    (an uneven vocabulary, decision 118) the tp pieces differ in length, and DTensor's own
    computation for _StridedShard (torch 2.13) then disagrees with what FSDP2 holds: vocabulary 1001
    on fsdp5 x tp4 gives (fsdp 4, tp 0) 48 rows where FSDP2 holds 47. So that pattern is computed
    here as FSDP2 cuts it (plain shards of a dim first, then the strided one, each a torch.chunk:
    `chunk_bounds`, the rule the offline planner uses), and everything else by DTensor."""
    fsdp_over_tp = _fsdp_over_tp_order(mesh_shape, placements)
    if fsdp_over_tp is None:
        sizes, offsets = _compute_local_shape_and_global_offset(global_shape, mesh_shape, coordinate, placements)
        return tuple(int(o) for o in offsets), tuple(int(s) for s in sizes)
    offsets, sizes = [0] * len(global_shape), list(global_shape)
    for mesh_dim in fsdp_over_tp:
        dim = placements[mesh_dim].dim
        start, stop = chunk_bounds(sizes[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        offsets[dim], sizes[dim] = offsets[dim] + start, stop - start
    return tuple(offsets), tuple(sizes)


def _fsdp_over_tp_order(mesh_shape, placements) -> list[int] | None:
    """The mesh dims in the order FSDP2 over tp applied them (each tensor dim's plain shards, then
    its strided one), or None unless every strided shard is FSDP2's: its split factor the product
    of the plain shards of its dim after it."""
    strided = [d for d, p in enumerate(placements) if isinstance(p, _StridedShard)]
    if not strided:
        return None
    plain = [d for d, p in enumerate(placements) if isinstance(p, Shard) and not isinstance(p, _StridedShard)]
    for mesh_dim in strided:
        placement = placements[mesh_dim]
        later = [d for d in plain if d > mesh_dim and placements[d].dim == placement.dim]
        if placement.split_factor != math.prod(mesh_shape[d] for d in later):
            return None
    if len({placements[d].dim for d in strided}) != len(strided):
        return None
    return plain + strided


@dataclass(frozen=True, eq=False)
class PipelineCopies:
    """The parameters a rank holds as pipeline copies of another stage's: the last stage's copy of
    tied embeddings. The first stage holds the original; a copy (and its optimizer moments) is
    never primary, so checkpoints write the tensor once and the gradient norm counts it once.
    The trainer knows its stages and passes this along; `param in copies` is by identity."""

    params: tuple[torch.Tensor, ...] = ()
    _ids: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_ids", frozenset(map(id, self.params)))  # the tuple keeps the ids alive

    def __contains__(self, tensor: object) -> bool:
        return id(tensor) in self._ids


NO_PIPELINE_COPIES = PipelineCopies()


def copy_dims(tensor: torch.Tensor) -> tuple[str, ...]:
    """The mesh dims along which other ranks hold an identical copy of this rank's piece (of any
    degree, in mesh order): the tensor's Replicate dims, and every data/tensor-parallel dim its
    mesh does not cover (a norm weight under FSDP lives on the (dp, fsdp) mesh but is also copied
    on every tp rank; under TP without FSDP it is a plain tensor copied on every tp rank)."""
    covered, copies = set(), set()
    if isinstance(tensor, DTensor):
        for dim, placement in zip(tensor.device_mesh.mesh_dim_names, tensor.placements):
            covered.add(dim)
            if isinstance(placement, Replicate):
                copies.add(dim)
    return tuple(dim for dim in STAGE_MESH_DIMS if dim in copies or dim not in covered)


def is_primary_replica(tensor: torch.Tensor, coords: dict[str, int],
                       copies: PipelineCopies = NO_PIPELINE_COPIES) -> bool:
    """True on exactly one rank among those holding identical copies of this piece: the copy at
    coordinate 0 of all its `copy_dims`. `coords` is this rank's position on the full mesh,
    e.g. {"dp": 1, "fsdp": 0, "tp": 1}. A pipeline copy (in `copies`) is never primary.

    (Checkpoints spread the writing of a replicated piece over its copies instead:
    `plans/checkpoint/replicas.py`.)"""
    return tensor not in copies and all(coords[dim] == 0 for dim in copy_dims(tensor))
