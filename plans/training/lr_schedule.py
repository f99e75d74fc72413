"""Linear warmup then cosine decay: a pure function of the step, so the schedule's whole state
is the step counter that the checkpoint already holds."""
from __future__ import annotations

import math


def learning_rate(step: int, lr: float, min_lr: float, warmup_steps: int, decay_steps: int) -> float:
    if warmup_steps and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    span = max(1, decay_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
