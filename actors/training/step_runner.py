"""The step-runner interface: how a rank turns one step's microbatches into gradients.

The trainer drives one `StepRunner` and never asks which kind it holds: `SingleStageRunner`
(`actors/training/single_stage.py`) runs the whole model on this rank with gradient accumulation;
`PipelinedRunner` (`actors/training/pipelined.py`) runs this rank's pipeline stages by replaying
the plan's action list. Both compute the same per-microbatch loss (`microbatch_loss`), so a layout
change never changes the numbers (torchtitan's `model_parts` serve the same purpose).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import ContextManager, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from rayshard.actors.parallel.shards import PipelineCopies
from rayshard.actors.pipeline.interpreter import StepRecord
from rayshard.actors.training.completion_loss import CompletionLoss
from rayshard.actors.training.preference_loss import PreferenceLoss


class ModelParts(Protocol):
    """What the optimizer, checkpoints and the gradient norm see of the model parts a rank runs:
    parameters under their global names (an `nn.Module`, or a pipeline rank's `RankStages`)."""

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def parameters(self) -> Iterator[nn.Parameter]: ...


class StepRunner(Protocol):
    model: ModelParts
    # Parameters this rank holds as copies of another stage's (a tied embedding's last-stage copy):
    # never primary, so checkpoints write them once and the gradient norm counts them once.
    pipeline_copies: PipelineCopies
    # How long the step's own collectives (gradient norm, loss all-reduce) may take; None waits
    # as long as the process group does.
    collective_timeout: timedelta | None

    def forward_backward(self, inputs: list[torch.Tensor],
                         targets: list[torch.Tensor]) -> tuple[torch.Tensor, StepRecord | None]:
        """Gradients of this step's microbatches, reduced over data ranks; returns this rank's
        share of the loss and, for a pipeline, the step's timings."""
        ...

    def wait(self, work, what: str) -> None:
        """Wait for one of the step's own collectives (`what` names it in errors)."""
        ...

    def after_forward_backward(self) -> ContextManager[None]:
        """Around the rest of the step (gradient norm, optimizer, loss all-reduce): a pipelined
        rank reports a failure there as a step failure that names the rank."""
        ...


def microbatch_loss(logits: torch.Tensor, targets: torch.Tensor, microbatches: int,
                    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Scaled by 1/microbatches: the microbatches' gradients then add up to the batch's.
    Computed in float32 whatever the logits' dtype (bf16 under mixed precision): the log-softmax
    over a vocabulary in bf16 would lose the loss's last digits.
    criterion: a user model's own (logits, targets) -> mean loss, kept apart from the model; it
    runs under the same `loss_context` (vocab-sharded logits under tp). None: cross-entropy."""
    if criterion is not None:
        if getattr(criterion, "sums_microbatches", False):  # --objective sft or dpo (completion_loss.py, preference_loss.py)
            return criterion(logits.float(), targets)
        return criterion(logits.float(), targets) / microbatches
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()) / microbatches


def objective_criterion(config) -> CompletionLoss | PreferenceLoss | None:
    """--objective sft's or dpo's loss (None: lm's, or a user model's own)."""
    if config.objective == "dpo":
        dpo = config.dpo
        return PreferenceLoss(config.layout.data_parallel_size, dpo.beta, dpo.loss, dpo.label_smoothing, dpo.precomputed)
    return CompletionLoss(config.layout.data_parallel_size) if config.objective == "sft" else None


def loss_context(tp: int) -> ContextManager:
    """Under tensor parallelism the logits stay sharded over the vocabulary: the loss runs under
    `loss_parallel` instead of gathering them."""
    return loss_parallel() if tp > 1 else contextlib.nullcontext()
