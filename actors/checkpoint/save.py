"""A rank's side of a save: which pieces it writes, and streaming them into its shard file.

Which replica writes is decided here, not by `rayshard.actors.parallel.shards.is_primary_replica` (the
grad-norm's rule, which always picks coordinate 0): each replica group splits its pieces by bytes
(`plans/checkpoint/replicas.py`'s `pieces_written`, which also predicts the writes of dry runs and
offline reshards), so dp replicas share the writing instead of replica 0 writing everything.
"""
from __future__ import annotations

import fsspec

from rayshard.actors.checkpoint.rank_pieces import rank_layout, replicated_dims, state_tensors, ties_embeddings
from rayshard.actors.checkpoint.shard_writer import Piece, write_shard
from rayshard.actors.parallel.shards import NO_PIPELINE_COPIES, PipelineCopies, local_region, local_tensor
from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.checkpoint.regions import EMBEDDING
from rayshard.plans.checkpoint.replicas import pieces_written


def pieces_to_write(model, optimizer, copies: PipelineCopies = NO_PIPELINE_COPIES,
                    only: frozenset[str] | None = None) -> list[Piece]:
    """This rank's share of the writing, in file order. copies: the rank's pipeline copies, which
    the rank holding the original writes. only: the parameters the run's checkpoints store (their
    role, `plans/training/parameter_roles.py`); None: every one."""
    layout, coords = rank_layout(model)
    tied = ties_embeddings(model)
    candidates, dims, nbytes = [], [], []
    for name, kind, tensor in state_tensors(model, optimizer, without=copies, only=only):
        offsets, sizes = local_region(tensor)
        if not all(sizes) and sizes:
            continue  # an empty FSDP shard (more shards than rows)
        if tied and name == EMBEDDING and coords.pp != 0:
            continue  # the last stage's copy of the tied embedding: the first stage writes it
        local = local_tensor(tensor)
        candidates.append(Piece(name, kind, local, tuple(tensor.shape), offsets))
        dims.append(replicated_dims(tensor, layout))
        nbytes.append(local.numel() * local.element_size())
    return [candidates[index] for index in pieces_written(dims, nbytes, layout, coords)]


def save_rank_shard(model, optimizer, coords: dict[str, int], checkpoint_url: str, file: str,
                    copies: PipelineCopies = NO_PIPELINE_COPIES, only: frozenset[str] | None = None) -> ChunkTable:
    """Stream this rank's share of the pieces to checkpoint_url/file; return their manifest rows
    as columns (a `ChunkTable`: the driver concatenates 16k ranks' columns, no record per chunk).
    `coords` is accepted for the caller's convenience; the rank's position is read off its meshes."""
    pieces = pieces_to_write(model, optimizer, copies, only)
    if not pieces:
        return ChunkTable.from_chunks([])
    fs, base = fsspec.core.url_to_fs(checkpoint_url)
    return ChunkTable.from_chunks(write_shard(fs, base, file, pieces))
