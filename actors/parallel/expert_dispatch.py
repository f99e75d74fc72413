"""How an MoE layer's routed tokens reach their experts when experts or their hidden units are
split over ranks (`MoEFeedForward.dispatch`; `parallelize.apply_expert_parallel` installs these).

Expert parallelism (ep > 1): the experts are split over the fsdp ranks, E / ep consecutive
experts each; those ranks hold different tokens. One all-to-all of counts tells every rank how
many tokens it will receive for each of its experts from each peer; one all-to-all sends the
tokens (grouped by expert, so by destination rank), the rank runs its experts, and a second
all-to-all returns the results in the order they came. Dropless, so the split sizes vary per step
(gloo and NCCL both take uneven splits). The token all-to-alls are torch's functional
`all_to_all_single_autograd`: differentiable (the backward is the reverse exchange), and an op
selective activation checkpointing can save instead of communicating again
(`actors/parallel/block_wrappers.SAVED_OPS`).

Tensor parallelism over experts: every tp rank routes the same tokens and holds every expert's
share of hidden units; each rank's expert outputs are partial sums, added over tp before the
router's weights scale them (so the router's gradient is the whole one on every tp rank), and
the gradient reaching the tokens is added over tp the same way (Megatron's copy-to / reduce-from
tensor-parallel region; the dense layers get the same from DTensor's styles).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional

from rayshard.actors.model.moe import Experts, RoutingStatistics


class _SumOverTensorParallel(torch.autograd.Function):
    """Forward: add the tp ranks' partial results. Backward: the gradient passes unchanged (every
    tp rank computes the same loss from the sum)."""

    @staticmethod
    def forward(ctx, partial, group):
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GradientSumOverTensorParallel(torch.autograd.Function):
    """Forward: unchanged. Backward: add the tp ranks' partial gradients (each rank's experts saw
    only its hidden units' share of the path back to the input)."""

    @staticmethod
    def forward(ctx, tokens, group):
        ctx.group = group
        return tokens

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def run_tensor_parallel_experts(tokens: torch.Tensor, counts: list[int], experts: Experts,
                                tp_group: dist.ProcessGroup | None) -> torch.Tensor:
    if tp_group is None:
        return experts(tokens, counts)
    partial = experts(_GradientSumOverTensorParallel.apply(tokens, tp_group), counts)
    return _SumOverTensorParallel.apply(partial, tp_group)


class TensorParallelDispatch:
    """ep = 1, tp > 1: every expert here, each with this tp rank's hidden units."""

    def __init__(self, tp_group: dist.ProcessGroup):
        self.tp_group = tp_group

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: Experts,
                 statistics: RoutingStatistics | None = None) -> torch.Tensor:
        return run_tensor_parallel_experts(routed, counts.tolist(), experts, self.tp_group)


def expert_major_order(received: torch.Tensor) -> torch.Tensor:
    """received[s, e]: tokens from peer s for local expert e, laid out source-major (as the
    all-to-all delivers them). Returns the row permutation that lays them out expert-major, each
    expert's rows in peer order."""
    sources, local = received.shape
    lengths = received.flatten()
    starts = (lengths.cumsum(0) - lengths).view(sources, local)
    expert_major_lengths, expert_major_starts = received.t().flatten(), starts.t().flatten()
    segment = torch.repeat_interleave(torch.arange(sources * local), expert_major_lengths)
    total = int(lengths.sum())
    segment_begin = torch.repeat_interleave(expert_major_lengths.cumsum(0) - expert_major_lengths, expert_major_lengths)
    return expert_major_starts[segment] + torch.arange(total) - segment_begin


def _exchange(rows: torch.Tensor, receive_splits: list[int], send_splits: list[int],
              group: dist.ProcessGroup) -> torch.Tensor:
    """Rows [sum(send_splits), dim] out to the group's ranks in order, rows from them back."""
    return functional.wait_tensor(functional.all_to_all_single_autograd(rows.contiguous(), receive_splits, send_splits, group))


class AllToAllDispatch:
    """ep > 1: experts split over `ep_group` (this rank holds experts [rank * E/ep, (rank+1) * E/ep))."""

    def __init__(self, ep_group: dist.ProcessGroup, tp_group: dist.ProcessGroup | None):
        self.ep_group, self.tp_group = ep_group, tp_group
        self.ep = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: Experts,
                 statistics: RoutingStatistics | None = None) -> torch.Tensor:
        local = counts.numel() // self.ep
        counts = counts.to(torch.int64)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.ep_group)  # [peer, local expert], flattened
        received = received.view(self.ep, local).cpu()
        send_splits = counts.view(self.ep, local).sum(dim=1).tolist()
        receive_splits = received.sum(dim=1).tolist()
        arrived = _exchange(routed, receive_splits, send_splits, self.ep_group)
        order = expert_major_order(received).to(routed.device)
        done = run_tensor_parallel_experts(arrived.index_select(0, order), received.sum(dim=0).tolist(), experts,
                                           self.tp_group)
        done = done.index_select(0, order.argsort())
        if statistics is not None:  # the forward's two token exchanges; the backward mirrors them
            row = routed.shape[1] * routed.element_size()
            statistics.record_exchange(row * (sum(send_splits) + sum(receive_splits)),
                                       row * (sum(send_splits) - send_splits[self.ep_rank]
                                              + sum(receive_splits) - receive_splits[self.ep_rank]))
        return _exchange(done, send_splits, receive_splits, self.ep_group)
