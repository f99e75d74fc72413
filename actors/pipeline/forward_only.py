"""A forward-only pass of every microbatch through the pipeline's stages, outside the schedule:
what `--objective dpo` needs of its frozen reference on pp > 1 (decision 190).

The policy's plan interleaves forwards and backwards; the reference has no backward and nothing
to overlap with, so it needs no plan: every rank walks the same global order, microbatch by
microbatch and stage by stage, and does the (microbatch, stage) steps whose stage it holds. A stage
takes the tokens (stage 0), its own previous stage's output (a virtual stage on this rank) or a
tensor received from the previous stage's rank, and sends its output to the next stage's rank.
The walk is a topological order of the transfers and sends never block the sender, so a receive
is only ever waited on a send its peer posts earlier in the same order: no cycle, no deadlock.
Activations move over torch.distributed between the stages' ranks, never through the driver.
Every wait is bounded by the pipeline timeout and names the rank, stage and microbatch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from rayshard.actors.pipeline.interpreter import wait_or_fail

# Above the interpreter's tags ((stage * microbatches + microbatch) * 2 + direction) and below the
# tied-embedding exchange's 2**30: a reference transfer never matches a schedule's.
_FORWARD_ONLY_TAG = 2**29


@torch.no_grad()
def forward_only(stages: dict[int, nn.Module], stage_ranks: Sequence[int], pp_rank: int, inputs: list[torch.Tensor],
                 last_stage: Callable[[torch.Tensor, int], torch.Tensor], *, global_rank_of: Callable[[int], int],
                 activation_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, timeout_s: float,
                 rank: int) -> list[torch.Tensor]:
    """Run `stages` (this rank's, stage index -> module) forward over every microbatch of `inputs`
    (token ids; only stage 0 reads them). `last_stage(output, microbatch)` turns the last stage's
    output into what the caller keeps; returns those in microbatch order (empty off the last stage)."""
    num_stages = len(stage_ranks)
    kept, sending = [], []
    for microbatch in range(len(inputs)):
        handed: torch.Tensor | None = None  # the previous stage's output, when that stage is this rank's
        for stage in range(num_stages):
            if stage_ranks[stage] != pp_rank:
                handed = None
                continue
            where = f"in the forward-only pass, stage {stage} microbatch {microbatch}"
            if stage == 0:
                x = inputs[microbatch]
            elif handed is not None:
                x = handed
            else:
                peer = global_rank_of(stage_ranks[stage - 1])
                x = torch.empty(activation_shape, dtype=dtype, device=device)
                receive = dist.P2POp(dist.irecv, x, peer, tag=_tag(stage, microbatch, len(inputs)))
                work = dist.batch_isend_irecv([receive])[-1]
                wait_or_fail(work, timeout_s, f"rank {rank}", f"{where} (from rank {peer})")
            output = stages[stage](x)
            if stage == num_stages - 1:
                kept.append(last_stage(output, microbatch))
                continue
            handed = output
            if stage_ranks[stage + 1] != pp_rank:
                peer = global_rank_of(stage_ranks[stage + 1])
                tensor = output.contiguous()
                work = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, peer,
                                                          tag=_tag(stage + 1, microbatch, len(inputs)))])[-1]
                sending.append((work, tensor, f"{where} (to rank {peer})"))
    for work, _, where in sending:
        wait_or_fail(work, timeout_s, f"rank {rank}", where)
    return kept


def _tag(receiving_stage: int, microbatch: int, microbatches: int) -> int:
    return _FORWARD_ONLY_TAG + receiving_stage * microbatches + microbatch
