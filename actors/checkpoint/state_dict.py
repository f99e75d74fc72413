"""A state dict as torch DCP takes it, seen as checkpoint pieces: flattened keys, each tensor's
piece on this rank (where it sits in the global tensor), and the non-tensor values.

A DTensor of any mesh and placements (FSDP2, TP, their `_StridedShard` mix, uneven shards) is
placed by DTensor's own `compute_local_shape_and_global_offset` (`local_region`, which the trainer
uses too, and which computes FSDP2's cut of an uneven tp piece itself: decision 118); a plain tensor is the whole tensor, held alike by every rank that has it. Non-tensor
leaves, and any subtree without a tensor in it (an optimizer's `param_groups`), are values kept
as JSON. `fill_values` puts loaded values back into the very containers they came from, so a
load fills the caller's state dict in place, as DCP's does.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Partial

from rayshard.actors.checkpoint.read_executor import Destination
from rayshard.actors.checkpoint.shard_writer import Piece, dtype_name
from rayshard.actors.parallel.shards import local_region, local_tensor
from rayshard.plans.checkpoint.safetensors_layout import SAFETENSORS_DTYPES
from rayshard.plans.checkpoint.reshard import Target
from rayshard.plans.checkpoint.save_plan import HeldPiece
from rayshard.plans.checkpoint.state_dict_keys import SEPARATOR, check_json_value, column_of
from rayshard.plans.errors import CheckpointError


@dataclass(frozen=True, slots=True)
class StatePiece:
    """One tensor of the state dict as this rank holds it: `held` describes the piece (what the
    other ranks learn), `local` is its bytes on this rank (a DTensor's local shard)."""

    key: str
    tensor: torch.Tensor  # as passed: a DTensor or a plain tensor
    local: torch.Tensor
    held: HeldPiece

    def piece(self, tensor: torch.Tensor | None = None) -> Piece:
        """What the shard writer takes (`tensor`: a host copy of `local`, for an async save)."""
        held = self.held
        return Piece(held.name, held.kind, self.local if tensor is None else tensor, held.global_shape, held.offsets)


@dataclass
class FlatState:
    """A state dict flattened: its tensors' pieces in traversal order, its JSON values by key,
    and where each value sits (to fill it in place)."""

    pieces: list[StatePiece] = field(default_factory=list)
    values: dict[str, object] = field(default_factory=dict)
    places: dict[str, tuple[object, object]] = field(default_factory=dict)  # key -> (container, index)
    # Every tensor's key -> (global shape, dtype), this rank's piece empty or not.
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)


def flatten(state_dict: Mapping) -> FlatState:
    """Refuses, in one line naming the key, what a checkpoint cannot hold: a Partial DTensor, a
    dtype safetensors lacks, a value that is neither a tensor nor JSON, two paths that flatten to
    one key."""
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(f"state_dict is a {type(state_dict).__name__}; pass a dict (of tensors, DTensors and "
                              "values, nested as torch.distributed.checkpoint takes them)")
    flat = FlatState()
    _walk(state_dict, "", flat)
    return flat


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensor(item) for item in value)
    return False


def _walk(container, prefix: str, flat: FlatState) -> None:
    items = container.items() if isinstance(container, Mapping) else enumerate(container)
    for index, value in items:
        key = f"{prefix}{index}"
        if isinstance(value, torch.Tensor):
            _add_tensor(key, value, flat)
        elif (isinstance(value, Mapping) or isinstance(value, (list, tuple))) and _holds_tensor(value):
            _walk(value, key + SEPARATOR, flat)
        else:
            check_json_value(key, value)
            _claim(key, flat)
            flat.values[key] = value
            flat.places[key] = (container, index)


def _claim(key: str, flat: FlatState) -> None:
    if key in flat.places:
        raise CheckpointError(f"state dict key {key!r} is reached by two paths (a key with a '.' in it beside a nested "
                              "dict of the same name). Fix: rename one of them")


def _add_tensor(key: str, tensor: torch.Tensor, flat: FlatState) -> None:
    _claim(key, flat)
    dtype = dtype_name(tensor.dtype)
    flat.tensors[key] = (tuple(tensor.shape), dtype)
    flat.places[key] = (None, None)  # a tensor is filled in place: no container to write into
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(f"state dict entry {key!r}: dtype {dtype} cannot be stored (rayshard stores "
                              f"{', '.join(SAFETENSORS_DTYPES)}). Fix: convert it before saving")
    if tensor.layout != torch.strided:
        raise CheckpointError(f"state dict entry {key!r}: a {tensor.layout} tensor; rayshard stores dense tensors. "
                              "Fix: convert it with .to_dense() before saving")
    if isinstance(tensor, DTensor) and any(isinstance(p, Partial) for p in tensor.placements):
        raise CheckpointError(f"state dict entry {key!r}: a DTensor with a Partial placement ({tensor.placements}) holds "
                              "unreduced partial sums, not a state. Fix: redistribute it to Shard or Replicate first")
    offsets, sizes = local_region(tensor)
    # Detached (the same memory): a piece may be a parameter that requires grad (a model's own
    # state dict), and filling it, whole or through a view, is not an operation autograd should see.
    local = local_tensor(tensor).detach()
    if local.device.type == "meta":
        raise CheckpointError(f"state dict entry {key!r} is on the meta device: it has a shape but no memory to save from "
                              "or load into. Fix: materialize the module first (module.to_empty(device=...))")
    if tuple(local.shape) != sizes:
        raise CheckpointError(f"state dict entry {key!r}: its local shard has shape {list(local.shape)} but its placements "
                              f"{tensor.placements} give {list(sizes)}; rayshard cannot place it in the global tensor")
    if sizes and not all(sizes) and all(tensor.shape):
        return  # an empty shard (more shards than rows) of a tensor that has elements: nothing held here
    # (A tensor with no elements at all is still a piece, of no bytes: the checkpoint then holds
    # its key, shape and dtype, as DCP's does, and a load of the same state dict finds it.)
    name, kind = column_of(key)
    flat.pieces.append(StatePiece(key, tensor, local, HeldPiece(name, kind, dtype, tuple(tensor.shape), offsets, sizes)))


def fill_values(flat: FlatState, stored: Mapping[str, object]) -> None:
    """Put the checkpoint's value of each of flat's JSON keys into its container, in the shape the
    caller's state dict had there (a tuple stays a tuple)."""
    for key in flat.values:
        container, index = flat.places[key]
        value = _like(stored[key], flat.values[key])
        if isinstance(container, tuple):
            if container[index] != value:
                raise CheckpointError(f"state dict entry {key!r} sits in a tuple, which cannot be filled in place, and "
                                      f"the checkpoint holds another value ({value!r}). Fix: use a list there")
            continue
        container[index] = value


def _like(value, template):
    """`value` (decoded JSON) with the containers `template` had: tuples where it had tuples."""
    if isinstance(template, tuple) and isinstance(value, list):
        return tuple(_like(item, model) for item, model in zip(value, template)) + tuple(value[len(template):])
    if isinstance(template, list) and isinstance(value, list):
        return [(_like(item, template[i]) if i < len(template) else item) for i, item in enumerate(value)]
    if isinstance(template, dict) and isinstance(value, dict):
        return {key: (_like(item, template[key]) if key in template else item) for key, item in value.items()}
    return value


def destinations(flat: FlatState) -> dict[Target, Destination]:
    """What a load fills on this rank: each piece's region of its stored tensor, straight into
    the state dict's own tensor (a DTensor's local shard)."""
    return {Target(p.held.name, p.held.kind, p.held.offsets, p.held.sizes): Destination(p.local, p.held.offsets)
            for p in flat.pieces}
