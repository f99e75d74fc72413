"""Deterministic, layout-independent initialisation of a rank's shard.

Every element's initial value depends only on (seed, parameter name, row), never on how the
tensor is split: row blocks of the global tensor are drawn from generators seeded by
(seed, name, block), and a rank draws just the blocks that overlap its shard. Training on any
layout therefore starts from the same global weights, which is what makes losses comparable
across layouts — without any rank ever holding a whole parameter.
"""
from __future__ import annotations

import hashlib
import math

import torch

from rayshard.actors.parallel.shards import local_region

ROWS_PER_BLOCK = 64


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_std(name: str, shape: tuple[int, ...], n_layers: int, zero_norms: bool = False) -> float | None:
    """None means 'ones' (norm weights), 0.0 zeros (biases, as transformers starts them).
    Output projections are scaled down with depth (GPT-2). zero_norms: norm weights start at
    zeros, Gemma's (1 + weight) norms' identity (ModelConfig.norm "rmsnorm_plus_one")."""
    if ".lora." in f".{name}":  # LoRA adapters (a user model's top-level Linear's: `lora.lm_head.a`): B zero (a run starts at its base), A of PEFT's default size
        return 0.0 if name.endswith(".b") else 1.0 / math.sqrt(shape[1])
    if name.endswith("norm.weight"):
        return 0.0 if zero_norms else None
    if name.endswith(".bias"):
        return 0.0
    if name.endswith(("attention.wo.weight", "feed_forward.down.weight", "feed_forward.experts.down.weight",
                      "feed_forward.shared.down.weight")):
        return 0.02 / math.sqrt(2 * n_layers)
    return 0.02


def global_rows(seed: int, name: str, shape: tuple[int, ...], std: float | None, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of the global initial tensor."""
    row_shape = tuple(shape[1:])
    if std is None:
        return torch.ones((stop - start, *row_shape))
    if std == 0.0:
        return torch.zeros((stop - start, *row_shape))
    pieces = []
    for block in range(start // ROWS_PER_BLOCK, (stop - 1) // ROWS_PER_BLOCK + 1 if stop > start else 0):
        block_start = block * ROWS_PER_BLOCK
        block_rows = min(ROWS_PER_BLOCK, shape[0] - block_start)
        generator = torch.Generator().manual_seed(_block_seed(seed, name, block))
        values = torch.randn((block_rows, *row_shape), generator=generator) * std
        lo, hi = max(start, block_start) - block_start, min(stop, block_start + block_rows) - block_start
        pieces.append(values[lo:hi])
    return torch.cat(pieces) if pieces else torch.empty((0, *row_shape))


@torch.no_grad()
def initialize_parameters(model: torch.nn.Module, seed: int, n_layers: int,
                          global_names: dict[str, str] | None = None, zero_norms: bool = False) -> None:
    """global_names: module name -> the global name whose values it takes (a pipeline stage's
    copy of tied embeddings, `output.weight`, starts as `tok_embeddings.weight`). zero_norms: see
    `init_std`."""
    global_names = global_names or {}
    for module_name, param in model.named_parameters():
        name = global_names.get(module_name, module_name)
        shape = tuple(param.shape)
        offsets, sizes = local_region(param)
        local = param.to_local() if hasattr(param, "to_local") else param
        if local.numel() == 0:
            continue
        std = init_std(name, shape, n_layers, zero_norms)
        if len(shape) == 0:
            local.copy_(torch.ones(()) if std is None else torch.zeros(()))
            continue
        rows = global_rows(seed, name, shape, std, offsets[0], offsets[0] + sizes[0])
        index = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:]))
        local.copy_(rows[(slice(None), *index)].to(local.dtype))
