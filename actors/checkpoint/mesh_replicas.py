"""Read-once replicas for `rayshard.checkpoint.load` from an object store: a piece several ranks
hold alike is read by one of them and broadcast to the rest (the dp half of decision 107's item 3;
the trainer's read-once load, decisions 19 and 35, for a state dict that carries no layout).

Which ranks hold a piece alike is read off the state dict itself. A DTensor replicated along a
mesh dim (HSDP's replicate dim; a norm weight on a dp x tp mesh) is held alike by the ranks along
that dim, the other coordinates fixed: they hand it over on that dim's own process group
(`mesh.get_group(dim)`: gloo for a CPU mesh, the caller's backend for a CUDA one). A DTensor
replicated on every dim of a mesh that spans the whole process group, and a plain tensor (which
the API saves as replicated, once), is held alike by every rank: they hand it over on the
checkpoint's own gloo group for CPU tensors, or on the caller's process group for CUDA tensors
where its backend is NCCL. Where a DTensor is replicated along several dims of a mesh smaller
than the group, the largest dim hands it over and the others read their own copies (a group
spanning several dims would be a new collective to make on every load).

Every member must list a group's pieces alike or the others would wait in a broadcast it never
joins, so replicas are agreed first, in the bands' exchange, group by group: each rank sends, per
group it hands over in, the group's identity (its kind and ranks), size and a digest of the
pieces it lists there (`group_signatures`: a few bytes per group, whatever the world size and the
number of pieces), and a group is agreed only where all its members sent the same digest
(`agreed_groups`); a group whose members list other pieces, or that some member does not list at
all, reads its pieces each member alone. Then each agreed group's pieces are split among its
members by bytes (`with_readers`), the same split on every member. A banded piece
(`mesh_bands.py`) is not also handed over here: its group already reads each of its bytes once
along the dim that cuts its columns. A group must serve the tensor's device (gloo for CPU, NCCL
for CUDA; FSDP2's CPU offload keeps CPU tensors on a CUDA mesh): one that does not hands nothing
over.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from rayshard.actors.checkpoint.state_dict import FlatState, StatePiece
from rayshard.actors.parallel.shards import region_at
from rayshard.plans.checkpoint.reshard import Target


@dataclass(frozen=True)
class ReplicaPiece:
    """One state-dict tensor this rank holds alike with the other members of `ranks`, read by
    one member (`reader`, a member index, set by `with_readers`) and broadcast to the others."""

    key: str
    target: Target
    local: torch.Tensor  # where it lands: this rank's local tensor
    group: object  # the process group the broadcast runs on
    ranks: tuple[int, ...]  # its global ranks, by group rank
    member: int  # this rank's index in `ranks`
    kind: str  # "whole" (the load's own group or the caller's) or "dim" (a mesh dim's): two groups of one ranks are two groups
    reader: int | None = None

    @property
    def nbytes(self) -> int:
        return self.local.numel() * self.local.element_size()

    @property
    def group_id(self) -> bytes:
        return _digest((self.kind, self.ranks))

    @property
    def signature(self) -> str:
        """What every member must list alike for the piece to be handed over."""
        return repr((self.key, self.target, str(self.local.dtype), tuple(self.local.shape), self.local.device.type))


def _digest(value) -> bytes:
    return hashlib.blake2b(repr(value).encode(), digest_size=16).digest()


def group_signatures(replicas: list[ReplicaPiece]) -> list[tuple[bytes, int, bytes]]:
    """Per group this rank hands over in: (its identity, its size, a digest of the pieces listed)."""
    by_group: dict[bytes, tuple[int, list[str]]] = {}
    for replica in replicas:
        by_group.setdefault(replica.group_id, (len(replica.ranks), []))[1].append(replica.signature)
    return [(group, size, _digest(sorted(signatures))) for group, (size, signatures) in by_group.items()]


def agreed_groups(listed: list[list[tuple[bytes, int, bytes]]]) -> set[bytes]:
    """On the first rank, from every rank's `group_signatures`: the groups every member listed,
    all with the same pieces."""
    digests: dict[bytes, set[bytes]] = {}
    members: dict[bytes, int] = {}
    sizes: dict[bytes, int] = {}
    for signatures in listed:
        for group, size, digest in signatures:
            digests.setdefault(group, set()).add(digest)
            members[group] = members.get(group, 0) + 1
            sizes[group] = size
    return {group for group in digests if len(digests[group]) == 1 and members[group] == sizes[group]}


def mesh_replicas(flat: FlatState, index, skip: set[str], checkpoint_group, caller_group) -> list[ReplicaPiece]:
    """This rank's pieces held alike by two or more ranks, with the group that hands each over.
    skip: keys handed over otherwise (banded). checkpoint_group: the load's own gloo group;
    caller_group: the process group the caller passed (None: the world)."""
    replicas = []
    for piece in flat.pieces:
        held = piece.held
        if piece.key in skip or (held.name, held.kind) not in index or piece.local.numel() == 0:
            continue
        found = _replica_group(piece, checkpoint_group, caller_group)
        if found is not None:
            group, ranks, kind = found
            me = dist.get_rank()
            if me in ranks:
                replicas.append(ReplicaPiece(piece.key, Target(held.name, held.kind, held.offsets, held.sizes),
                                             piece.local, group, ranks, ranks.index(me), kind))
    return replicas


def _replica_group(piece: StatePiece, checkpoint_group, caller_group) -> tuple[object, tuple[int, ...], str] | None:
    tensor = piece.tensor
    if not isinstance(tensor, DTensor):
        return _whole_group(piece.local, checkpoint_group, caller_group)
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    mesh_shape = tuple(mesh.shape)
    replicated = [dim for dim, placement in enumerate(tensor.placements)
                  if isinstance(placement, Replicate) and mesh_shape[dim] > 1]
    if not replicated:
        return None
    everywhere = all(isinstance(p, Replicate) or size == 1 for p, size in zip(tensor.placements, mesh_shape))
    whole = _whole_group(piece.local, checkpoint_group, caller_group)
    if everywhere and whole is not None and sorted(mesh.mesh.flatten().tolist()) == sorted(whole[1]):
        return whole
    dim = max(replicated, key=lambda d: (mesh_shape[d], -d))
    shape = tuple(piece.held.global_shape)
    ranks, regions = [], set()
    for member in range(mesh_shape[dim]):
        at = list(coordinate)
        at[dim] = member
        regions.add(region_at(shape, mesh_shape, at, tensor.placements))
        ranks.append(int(mesh.mesh[tuple(at)].item()))
    if len(regions) != 1:
        return None  # (a Replicate dim holds one region on every member; anything else is not handed over)
    group = mesh.get_group(dim)
    if tuple(dist.get_process_group_ranks(group)) != tuple(ranks) or not _serves(group, piece.local.device.type):
        return None  # a member index must be its group rank; the broadcast must carry the tensor's device
    return group, tuple(ranks), "dim"


def _whole_group(local: torch.Tensor, checkpoint_group, caller_group) -> tuple[object, tuple[int, ...], str] | None:
    """The group every rank of the load hands a piece over on, for a tensor on `local`'s device."""
    if local.device.type == "cpu":
        group = checkpoint_group
    elif local.device.type == "cuda" and _serves(caller_group or dist.group.WORLD, "cuda"):
        group = caller_group or dist.group.WORLD
    else:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    return (group, ranks, "whole") if len(ranks) > 1 else None


def _serves(group, device_type: str) -> bool:
    """Whether `group`'s backend carries tensors of `device_type` ("gloo", "nccl", or per device
    as "cpu:gloo,cuda:nccl")."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:
        return any(part.split(":")[0] == device_type for part in backend.split(","))
    return {"gloo": "cpu", "nccl": "cuda"}.get(backend) == device_type


def with_readers(replicas: list[ReplicaPiece]) -> list[ReplicaPiece]:
    """Each piece's reader: within each group, pieces by key, each to the member with the fewest
    bytes so far (the lowest on ties), so every member computes the same split from the same list."""
    by_group: dict[tuple[int, ...], list[ReplicaPiece]] = {}
    for replica in replicas:
        by_group.setdefault(replica.ranks, []).append(replica)
    assigned = []
    for ranks, members in by_group.items():
        load = [0] * len(ranks)
        for replica in sorted(members, key=lambda r: r.key):
            reader = min(range(len(ranks)), key=lambda m: (load[m], m))
            load[reader] += replica.nbytes
            assigned.append(replace(replica, reader=reader))
    return assigned
