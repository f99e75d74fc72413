"""A rank's side of a save: which pieces it writes, and streaming them into its shard file.

Which replica writes is decided here, not by `actors.model.shards.is_primary_replica` (the
grad-norm's rule, which always picks coordinate 0): each replica group splits its pieces by bytes
(`plans/checkpoint/writers.py`), so dp replicas share the writing instead of replica 0 writing
everything.
"""
from __future__ import annotations

import fsspec
import torch

from actors.checkpoint.rank_pieces import is_pipeline_copy, local_tensor, ties_embeddings, rank_layout, replicated_dims, state_tensors
from actors.checkpoint.shard_writer import write_shard
from actors.model.shards import local_region
from plans.checkpoint.regions import EMBEDDING, replica_members
from plans.checkpoint.writers import assign_writers, file_position, group_salt


def pieces_to_write(model, optimizer) -> list[tuple[str, str, torch.Tensor, tuple, tuple]]:
    """This rank's share of the writing: (name, kind, local tensor, global shape, global offsets)."""
    layout, coords = rank_layout(model)
    tied = ties_embeddings(model)
    candidates = []
    for name, kind, tensor in state_tensors(model, optimizer):
        offsets, sizes = local_region(tensor)
        if not all(sizes) and sizes:
            continue  # an empty FSDP shard (more shards than rows)
        if is_pipeline_copy(tensor) or (tied and name == EMBEDDING and coords.pp != 0):
            continue  # the last stage's copy of the tied embedding: the first stage writes it
        candidates.append((name, kind, local_tensor(tensor), tuple(tensor.shape), offsets, replicated_dims(tensor, layout)))
    groups: dict[tuple[str, ...], list[int]] = {}
    for index, candidate in enumerate(candidates):
        groups.setdefault(candidate[5], []).append(index)
    chosen = [True] * len(candidates)
    for dims, members in groups.items():
        if not dims:
            continue
        mine, size = replica_members(layout, coords, dims)
        nbytes = [candidates[i][2].numel() * candidates[i][2].element_size() for i in members]
        for index, writer in zip(members, assign_writers(nbytes, size, group_salt(dims, coords))):
            chosen[index] = writer == mine
    mine = [c for c, keep in zip(candidates, chosen) if keep]
    return [c[:5] for c in sorted(mine, key=lambda c: file_position(c[5]))]


def save_rank_shard(model, optimizer, coords: dict[str, int], checkpoint_url: str, file: str) -> list[dict]:
    """Stream this rank's share of the pieces to checkpoint_url/file; return their manifest rows.
    `coords` is accepted for the caller's convenience; the rank's position is read off its meshes."""
    pieces = pieces_to_write(model, optimizer)
    if not pieces:
        return []
    fs, base = fsspec.core.url_to_fs(checkpoint_url)
    return [chunk.to_row() for chunk in write_shard(fs, base, file, pieces)]
