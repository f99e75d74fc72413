"""A rank's side of checkpoints: which pieces it writes, and how it fills its shard on load.

Layout-free in both directions: a piece is written with its global name and region by the one
rank that is its primary holder, and a load reads, for each local piece, only the byte ranges of
stored chunks that overlap it — so any layout can load what any other layout wrote.
"""
from __future__ import annotations

import fsspec
import torch

from actors.checkpoint_io import decode_manifest, dtype_name, encode_shard, fill_from_reads
from actors.shards import is_primary_replica, local_region
from plans.chunks import EXP_AVG, EXP_AVG_SQ, PARAM, Chunk
from plans.errors import CheckpointError
from plans.reshard import plan_reads

MANIFEST = "manifest.parquet"
MOMENTS = (EXP_AVG, EXP_AVG_SQ)


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """(global name, kind, tensor) for every piece of training state: params and AdamW moments."""
    for name, param in model.named_parameters():
        yield name, PARAM, param
        state = optimizer.state.get(param, {})
        for kind in MOMENTS:
            if kind in state:
                yield name, kind, state[kind]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def save_rank_shard(model, optimizer, coords: dict[str, int], checkpoint_url: str, file: str) -> list[dict]:
    """Write this rank's primary pieces to checkpoint_url/file; return their manifest rows."""
    pieces = []
    for name, kind, tensor in state_tensors(model, optimizer):
        if is_primary_replica(tensor, coords):
            offsets, _ = local_region(tensor)
            pieces.append((name, kind, _local(tensor), tuple(tensor.shape), offsets))
    if not pieces:
        return []
    data, chunks = encode_shard(pieces, file)
    fs, base = fsspec.core.url_to_fs(checkpoint_url)
    fs.makedirs(f"{base}/{file}".rsplit("/", 1)[0], exist_ok=True)
    fs.pipe_file(f"{base}/{file}", data)
    return [chunk.to_row() for chunk in chunks]


def read_manifest(checkpoint_url: str) -> tuple[list[Chunk], dict]:
    fs, base = fsspec.core.url_to_fs(checkpoint_url)
    where = f"{checkpoint_url}/{MANIFEST}"
    try:
        data = fs.cat_file(f"{base}/{MANIFEST}")
    except FileNotFoundError:
        raise CheckpointError(f"{where} does not exist: not a committed checkpoint") from None
    return decode_manifest(data, where)


@torch.no_grad()
def load_rank_shard(model, optimizer, checkpoint_url: str, all_parameter_names: set[str]) -> dict:
    """Fill this rank's params and AdamW state from a checkpoint written by any layout.

    all_parameter_names: every parameter of the whole model (not only this rank's stage), so a
    key is 'unexpected' only if no rank of the model could own it.
    """
    chunks, metadata = read_manifest(checkpoint_url)
    by_tensor: dict[tuple[str, str], list[Chunk]] = {}
    for chunk in chunks:
        by_tensor.setdefault((chunk.name, chunk.kind), []).append(chunk)
    check_matches(model, by_tensor, all_parameter_names, checkpoint_url)
    step = int(metadata["step"])
    for param in model.parameters():  # AdamW state must exist before it can be filled
        optimizer.state[param] = {"step": torch.tensor(float(step)),
                                  EXP_AVG: torch.zeros_like(param), EXP_AVG_SQ: torch.zeros_like(param)}
    fs, base = fsspec.core.url_to_fs(checkpoint_url)
    bytes_read = 0
    for name, kind, tensor in state_tensors(model, optimizer):
        offsets, sizes = local_region(tensor)
        items = plan_reads(by_tensor[(name, kind)], offsets, sizes, what=f"{name} ({kind})")
        bytes_read += fill_from_reads(fs, base, items, _local(tensor), offsets)
    return {"step": step, "bytes_read": bytes_read, "metadata": metadata}


def check_matches(model, by_tensor: dict, all_parameter_names: set[str], where: str) -> None:
    """One error listing every missing key, unexpected key and shape or dtype mismatch."""
    kinds = (PARAM, *MOMENTS)
    expected = {(name, kind): (tuple(param.shape), dtype_name(param.dtype))
                for name, param in model.named_parameters() for kind in kinds}
    possible = {(name, kind) for name in all_parameter_names for kind in kinds}
    stored = {key: (group[0].global_shape, group[0].dtype) for key, group in by_tensor.items()}
    missing = sorted(f"{n} ({k})" for n, k in expected.keys() - stored.keys())
    unexpected = sorted(f"{n} ({k})" for n, k in stored.keys() - possible)
    mismatched = sorted(f"{n} ({k}): checkpoint {stored[(n, k)][1]}{list(stored[(n, k)][0])}, "
                        f"model {expected[(n, k)][1]}{list(expected[(n, k)][0])}"
                        for n, k in expected.keys() & stored.keys() if stored[(n, k)] != expected[(n, k)])
    if missing or unexpected or mismatched:
        lines = [f"checkpoint {where} does not match the model:"]
        for title, entries in (("missing keys", missing), ("unexpected keys", unexpected),
                               ("shape/dtype mismatches", mismatched)):
            if entries:
                lines.append(f"  {title} ({len(entries)}): " + "; ".join(entries[:20]) + (" ..." if len(entries) > 20 else ""))
        lines.append("  Fix: resume with the model settings the checkpoint was written with (`model` in its manifest metadata).")
        raise CheckpointError("\n".join(lines))
