"""The global gradient norm, and the clip by it.

The norm must not depend on the layout: only on the gradient values, however a layout cuts them
into pieces and spreads them over ranks. The clip scales every gradient by it, so one ulp of
difference between two layouts' norms sets them on paths that drift apart (decision 46).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from rayshard.actors.parallel.shards import NO_PIPELINE_COPIES, PipelineCopies, is_primary_replica


def squares_sum(pieces: list[torch.Tensor]) -> torch.Tensor:
    """The sum of the squares of every element, in float64.

    Why float64: the float32 sum of the same squares depends on how a layout cuts the pieces and
    groups them on ranks (dp2 x tp2 and tp2 holding bit-equal gradients gave norms one ulp
    apart), and the clip scales every gradient by the norm: one ulp a few dozen steps in set the
    two layouts on paths 2e-5 apart by step 150 (docs/decisions.md 46). Summed in float64 and
    rounded to float32 once, the norm depends on the gradient values alone (a layout's float64
    rounding would have to straddle a float32 boundary: odds ~1e-9 a step).

    On a CPU the pieces are converted an L2-sized chunk at a time into one float64 buffer: the
    float64 copy of every gradient that `_foreach_norm(dtype=float64)` makes cost 4% of a small
    preset's step, most of the gradient norm's time (bench/RESULTS.md, throughput)."""
    if pieces[0].device.type != "cpu":
        return torch.stack(torch._foreach_norm(pieces, 2, dtype=torch.float64)).square().sum()
    total = torch.zeros((), dtype=torch.float64)
    buffer = torch.empty(min(_NORM_CHUNK, max(piece.numel() for piece in pieces)), dtype=torch.float64)
    for piece in pieces:
        for part in piece.reshape(-1).split(_NORM_CHUNK):
            converted = buffer[:part.numel()]
            converted.copy_(part)  # exact: every float32 is a float64, and so is its square's sum term
            total += torch.dot(converted, converted)
    return total


# float64 elements: 512 KiB, plus the 256 KiB of float32 it is converted from, stays in a core's
# L2 between the copy and the dot. Measured on the small preset's gradients (thread time, medians of
# 5): 2^14 28.8 ms, 2^15 23.3, 2^16 21.3, 2^17 21.9, 2^18 26.6 on a 2 MiB-L2 Xeon, where 2^18
# (3 MiB in all) spills; the dot itself is 3 ms of it, the float32 -> float64 copy the rest.
_NORM_CHUNK = 1 << 16


@torch.no_grad()
def clip_grad_norm(parameters, max_norm: float, coords: dict[str, int], timeout: timedelta | None = None,
                   copies: PipelineCopies = NO_PIPELINE_COPIES) -> torch.Tensor:
    """Global gradient L2 norm over all ranks, then scale gradients in place.

    Each rank sums the squares of the gradient pieces it is the primary holder of (coordinate 0
    along the piece's copy dims, `shards.is_primary_replica`; checkpoint writers instead split a
    replica group's pieces by bytes, decision 15), and one all-reduce over the world
    adds them up. One collective gives every rank the identical norm, so replicas apply the same
    clip factor; torch's clip_grad_norm_ instead fails on parameters that live on different
    meshes, and reducing per mesh takes several sequential all-reduces whose order can differ.
    timeout: fail (rather than wait for the process group's timeout) if the all-reduce takes longer.
    copies: the rank's pipeline copies (a tied embedding's last-stage copy): counted by the first stage.
    """
    parameters = list(parameters)
    with_grads = [p for p in parameters if p.grad is not None]
    for param in with_grads:
        # A gradient left Partial (sequence-parallel norm weights without FSDP to reduce them:
        # each tp rank holds its tokens' share) is summed over its mesh first; its local piece is
        # not the gradient, and counting the pieces would give sum |p_i|^2, not |sum p_i|^2.
        grad = param.grad
        if hasattr(grad, "placements") and any(placement.is_partial() for placement in grad.placements):
            param.grad = grad.redistribute(grad.device_mesh, param.placements)
    grads = [p.grad for p in with_grads]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    # On the parameters' device even where this rank holds no gradient: NCCL reduces device tensors only.
    squared = torch.zeros((), dtype=torch.float64, device=parameters[0].device if parameters else None)
    # Replication follows the gradient (DTensor may replicate a sharded parameter's gradient);
    # being a pipeline copy (tied embeddings) is a property of the parameter.
    owned = [piece for param, grad, piece in zip(with_grads, grads, local)
             if param not in copies and is_primary_replica(grad, coords) and piece.numel()]
    if owned:
        squared = squares_sum(owned)
    if dist.is_initialized():
        work = dist.all_reduce(squared, async_op=True)
        work.wait(timeout) if timeout is not None else work.wait()
    total = squared.sqrt().float()  # rounded once, from float64: the same on every layout
    if max_norm > 0 and local:
        # A multiply of its own, not fused AdamW's grad_scale (which divides): measured, the
        # division kept one pass fewer but a resume on another layout drifted 10-30x further
        # from the uninterrupted run (decision 81).
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        torch._foreach_mul_(local, scale)
    return total
