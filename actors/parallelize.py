"""Apply tensor and data parallelism to a single-device model, from outside.

TP is DTensor's `parallelize_module` driven by a plan keyed by module-name patterns (the
user-facing form: a model written as plain code plus a mapping of names to styles). Sharded
and replicated data parallelism are FSDP2's `fully_shard` on a (dp, fsdp) mesh — HSDP, which
also covers plain DP (fsdp=1) and plain FSDP (dp=1). We write none of these collectives.
"""
from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from actors.shards import is_primary_replica

# Why these styles: qkv and gate_up are column-parallel (their row blocks are whole head groups /
# hidden units, see plans/model_spec.py), wo and down row-parallel so the pair needs one
# all-reduce; the embedding is vocab-parallel, and the LM head leaves logits sharded over the
# vocabulary so the loss runs under `loss_parallel` without ever gathering full logits.
DEFAULT_TP_PLAN: dict[str, ParallelStyle] = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    "layers.*.attention.qkv": ColwiseParallel(),
    "layers.*.attention.wo": RowwiseParallel(),
    "layers.*.feed_forward.gate_up": ColwiseParallel(),
    "layers.*.feed_forward.down": RowwiseParallel(),
    "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
}


def resolve_tp_plan(model: nn.Module, patterns: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Expand module-name patterns (fnmatch) to the concrete module names present in `model`."""
    resolved: dict[str, ParallelStyle] = {}
    names = [name for name, _ in model.named_modules() if name]
    for pattern, style in patterns.items():
        for name in fnmatch.filter(names, pattern):
            resolved[name] = style
    return resolved


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, patterns=None) -> None:
    plan = resolve_tp_plan(model, DEFAULT_TP_PLAN if patterns is None else patterns)
    parallelize_module(model, tp_mesh, plan)


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh) -> None:
    """FSDP2 per transformer block (so only one block is gathered at a time), then the root."""
    blocks = getattr(model, "layers", {})
    for block in blocks.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


def parallelize(model: nn.Module, mesh: DeviceMesh, tp: int, data_parallel_size: int,
                tie_embeddings: bool = False) -> nn.Module:
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
        if tie_embeddings:
            # parallelize_module gives each module its own DTensor parameter; both are
            # Shard(0) over the vocabulary on the same mesh, so one can serve both again.
            model.output.weight = model.tok_embeddings.weight
    if data_parallel_size > 1:
        apply_data_parallel(model, mesh["dp", "fsdp"])
    return model


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, coords: dict[str, int]) -> torch.Tensor:
    """Global gradient L2 norm over all ranks, then scale gradients in place.

    Each rank sums the squares of the gradient pieces it is the primary holder of (the same
    rule that decides who writes a piece to a checkpoint), and one all-reduce over the world
    adds them up. One collective gives every rank the identical norm, so replicas apply the same
    clip factor; torch's clip_grad_norm_ instead fails on parameters that live on different
    meshes, and reducing per mesh takes several sequential all-reduces whose order can differ.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    squared = torch.zeros((), dtype=torch.float32, device=local[0].device if local else None)
    owned = [piece for grad, piece in zip(grads, local) if is_primary_replica(grad, coords) and piece.numel()]
    if owned:
        squared = torch.stack([norm.float() for norm in torch._foreach_norm(owned)]).square().sum()
    if dist.is_initialized():
        dist.all_reduce(squared)
    total = squared.sqrt()
    if max_norm > 0 and local:
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(local, scale)
    return total
