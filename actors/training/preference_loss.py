"""`--objective dpo`'s loss: Direct Preference Optimization against a frozen reference, the mean
over the global batch's pairs, the same number on every layout.

A step's rows are pairs, chosen then rejected (actors/training/dataset_reader.py's rank_pairs), and
a microbatch holds whole pairs. A row's log-probability is the sum over its response tokens (the
targets that are not IGNORE, as --objective sft's) of log p(target): -cross_entropy with
reduction='none', which under tp's `loss_parallel` runs on the vocab-sharded logits as they are.
The reference's log-probabilities come from the runner (the base with adapters disabled, or a
frozen copy), computed under no_grad before the policy's forward of the same microbatch.

Each microbatch adds its pairs' summed loss times data_ranks / P, P the global batch's pairs, as
CompletionLoss does with tokens: gradient accumulation adds microbatches, the data-parallel
reduction averages over data ranks, so the gradient is that of the mean over the global batch.
The rewards (beta (log pi - log ref)) and accuracy are summed the same way, reported per step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from rayshard.actors.training.completion_loss import IGNORE

# rewards/chosen, rewards/rejected, rewards/margin, rewards/accuracy: each a mean over the global batch's pairs.
REWARD_METRICS = ("rewards_chosen", "rewards_rejected", "rewards_margin", "rewards_accuracy")


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[rows] summed log-probabilities of each row's counted targets (IGNORE targets add 0).
    Run under `loss_context`: under tp the logits are vocab-sharded and the result is whole."""
    rows = targets.shape[0]
    per_token = -F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")
    if hasattr(per_token, "full_tensor"):  # loss_parallel's result is a replicated DTensor: the same on every tp rank
        per_token = per_token.full_tensor()
    return per_token.view(rows, -1).sum(-1)


def dpo_losses(policy: torch.Tensor, reference: torch.Tensor, beta: float, loss: str,
               label_smoothing: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the loss, and the chosen and rejected rewards (detached). policy and reference
    are [2 * pairs] row log-probabilities, chosen at even rows, rejected at odd ones."""
    chosen, rejected = policy[0::2] - reference[0::2], policy[1::2] - reference[1::2]
    margin = chosen - rejected
    if loss == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * margin) * (1 - label_smoothing) - F.logsigmoid(-beta * margin) * label_smoothing
    return losses, beta * chosen.detach(), beta * rejected.detach()


class PreferenceLoss:
    """A criterion (logits, targets) -> this microbatch's share of the global batch's mean DPO
    loss. set_step tells it the global pairs and each microbatch's reference log-probabilities
    (in microbatch order) before the step's first forward."""

    sums_microbatches = True  # already a share of the batch: microbatch_loss must not divide it again
    needs_reference = True    # the runner computes the reference's log-probabilities of each microbatch

    def __init__(self, data_ranks: int, beta: float, loss: str, label_smoothing: float, precomputed: bool = False):
        self.data_ranks, self.beta, self.loss, self.label_smoothing = data_ranks, beta, loss, label_smoothing
        self.precomputed = precomputed  # the trainer sets the references from the dataset; the runner runs none
        self.scale: float | None = None
        self.references: list[torch.Tensor] = []
        self.rewards = torch.zeros(len(REWARD_METRICS), dtype=torch.float64)

    def set_step(self, global_pairs: int) -> None:
        self.scale = self.data_ranks / max(1, int(global_pairs))
        self.rewards = torch.zeros(len(REWARD_METRICS), dtype=torch.float64)
        # A pipeline rank off the last stage is handed its rows' values too but never takes them:
        # each step starts afresh. The last stage takes them in microbatch order (every schedule
        # runs a stage's forwards in microbatch order).
        self.references = []

    def set_reference(self, reference_logps: torch.Tensor) -> None:
        """The reference's row log-probabilities of the microbatch the next call takes."""
        self.references.append(reference_logps.detach())

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.scale is not None and self.references, "set_step and set_reference first"
        reference = self.references.pop(0)
        losses, chosen, rejected = dpo_losses(sequence_logps(logits, targets), reference, self.beta, self.loss,
                                              self.label_smoothing)
        self.rewards += torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
                                     (chosen > rejected).sum()]).double().cpu() * self.scale
        return losses.sum() * self.scale
