"""AdamW that steps each DTensor parameter's local shard directly, not through DTensor's dispatch.

AdamW is elementwise: a shard's update needs only that shard's gradient and moments, which live
on the same rank with the same placements as the shard. DTensor's dispatch of the fused kernel
computes exactly that, but first plans the sharding of the one foreach op over every tensor of the
group; that plan is not cached across processes, so every rank's first step paid it (a fresh
rank's first step at the small preset on dp2 x tp2: 0.93-1.02 CPU-seconds against 0.67-0.75
here, docs/decisions.md 210), and a recovery pays it again on every rank. Here the same kernel
(`torch.optim.adam.adam`, fused when the group is) runs on the local tensors, so the values are
bit for bit those DTensor's path computes.

Where a parameter's gradient or moments are not laid out as the parameter (a Partial gradient that
still needs its reduction, another mesh), the group takes DTensor's path, which redistributes them
first: never a local step on the wrong values. The moments stay DTensors in `state`, so
checkpoints see them as before.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from rayshard.actors.parallel.shards import local_tensor


def _same_layout(param: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether every one of `others` is sharded exactly as `param` (or none is a DTensor)."""
    if not isinstance(param, DTensor):
        return not any(isinstance(other, DTensor) for other in others)
    return all(isinstance(other, DTensor) and other.placements == param.placements
               and other.device_mesh == param.device_mesh and other._local_tensor.shape == param._local_tensor.shape
               for other in others)


class LocalShardAdamW(torch.optim.AdamW):
    """torch.optim.AdamW, stepping the local shards (see the module's docstring)."""

    @torch.no_grad()
    def step(self, closure=None):
        self._accelerator_graph_capture_health_check()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps = [], [], [], [], [], []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
            moments = zip(exp_avgs, exp_avg_sqs, max_exp_avg_sqs or [None] * len(params))
            local = all(_same_layout(p, g, m, v, *([] if s is None else [s]))
                        for p, g, (m, v, s) in zip(params, grads, moments))
            lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs)
            if local:
                lists = tuple([local_tensor(t) for t in tensors] for tensors in lists)
            beta1, beta2 = group["betas"]
            adam(*lists, state_steps, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                 lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                 fused=group["fused"], grad_scale=getattr(self, "grad_scale", None),
                 found_inf=getattr(self, "found_inf", None), decoupled_weight_decay=group["decoupled_weight_decay"])
        return loss
