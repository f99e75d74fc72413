"""`--objective sft`'s loss: the mean cross-entropy over the completion tokens of the whole global
batch, the same number on every layout.

A target the loss must not count (a prompt token, padding) is IGNORE in the targets, so the mask
travels wherever the targets go (to the last pipeline stage with them). Each microbatch adds its
completion tokens' summed loss times data_ranks / N, N the global batch's completion tokens (a pure
function of seed and step, read from the dataset's index, never a collective): gradient
accumulation adds the microbatches up, and the data-parallel reduction, which averages over the
data ranks, multiplies by 1 / data_ranks, so the gradient is that of sum / N over the global batch
whatever the microbatches and data ranks. Prompt tokens never enter the sum: they get no gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # torch's and transformers' ignore_index: a target no loss counts


class CompletionLoss:
    """A criterion (logits, targets) -> this microbatch's share of the global batch's mean loss.
    set_step tells it the step's global completion-token count before the step's first forward."""

    sums_microbatches = True  # already a share of the batch: microbatch_loss must not divide it again

    def __init__(self, data_ranks: int):
        self.data_ranks = data_ranks
        self.scale: float | None = None

    def set_step(self, global_loss_tokens: int) -> None:
        # Every example has a completion target (prepare refuses an empty completion, and the
        # end-of-document token is one), so N >= 1; the max only keeps a malformed index from dividing by 0.
        self.scale = self.data_ranks / max(1, int(global_loss_tokens))

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.scale is not None, "set_step first: the loss needs the global batch's completion-token count"
        total = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
        return total * self.scale
