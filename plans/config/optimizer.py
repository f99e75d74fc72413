"""The optimizer section: AdamW and its warmup-cosine learning-rate schedule."""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.options import file_only, option


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW's settings, gradient clipping, and the schedule: linear warmup to lr over
    warmup_steps, then a cosine down to min_lr over decay_steps (None: the run's total steps)."""

    lr: float = option(3e-3, metavar="LR", help="peak learning rate")
    min_lr: float = file_only(3e-4)
    warmup_steps: int = option(10, metavar="N", help="steps of linear learning-rate warmup")
    decay_steps: int | None = file_only(None)
    weight_decay: float = file_only(0.1)
    beta1: float = file_only(0.9)
    beta2: float = file_only(0.95)
    eps: float = file_only(1e-8)
    grad_clip: float = file_only(1.0)

    def validate(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError("optimizer.lr", self.lr, "need lr > 0 and 0 <= min_lr <= lr", "adjust --lr / optimizer.min_lr")
        if self.warmup_steps < 0:
            raise ConfigError("optimizer.warmup_steps", self.warmup_steps, "must be >= 0", "set it to 0 or more")
