"""Model converters: what changes a built model before it is parallelized (LoRA first).

Applied to the meta-device model (or pipeline stage) after it is built and carved, before tensor
and data parallelism, so every converter's parameters are placed, materialised, initialised and
checkpointed like the model's own. Its plan side (which parameters it adds, freezes and stores, and
their tp styles) lives in plans/training (`converters.py`); a new converter is a
file of each plus its line below.
"""
from __future__ import annotations

from torch import nn

from rayshard.actors.model.lora import apply_lora, apply_user_lora
from rayshard.actors.parallel.precision import compute_dtype


def convert_model(model: nn.Module, config) -> nn.Module:
    """`config`: the TrainConfig. Returns the model, changed in place."""
    lora = config.lora
    if lora.enabled:
        precision = config.numerics.precision
        convert = apply_user_lora if config.model.spec.user is not None else apply_lora
        convert(model, config.model.spec, lora, compute_dtype(precision) if precision != "fp32" else None)
    return model
