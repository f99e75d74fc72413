"""Which parameters a run trains and which its checkpoints store: the parameter roles seam.

Full training trains and stores every parameter of the model. A model converter (LoRA first,
`plans/training/lora.py`; the run's converters: `plans/training/converters.py`) adds parameters
and freezes others: the optimizer then holds only the trained ones (no moments for the frozen),
gradient clipping and reduction see only them, and a checkpoint stores only what its role says is
stored, so its manifest, its model check and a load all read the same record instead of assuming that "trained", "stored" and "present" are one set.

A frozen parameter is not stored in the run's checkpoints: it comes from the base (a checkpoint
named by reference and digest, or the seeded initial weights), which the run never modifies.

Pure: names, shapes and roles, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.training.model_spec import ModelConfig, parameter_shapes


@dataclass(frozen=True)
class ParameterRole:
    """trained: the optimizer steps it (it has a gradient and AdamW moments). stored: the run's
    checkpoints hold it (and its moments, when trained)."""

    trained: bool
    stored: bool


TRAINED = ParameterRole(trained=True, stored=True)
FROZEN = ParameterRole(trained=False, stored=False)  # read from the base, never written by the run


@dataclass(frozen=True)
class ParameterRoles:
    """Every parameter the run's model has (global name, global shape, role), in module order."""

    parameters: tuple[tuple[str, tuple[int, ...], ParameterRole], ...]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter present in the model, stored or not."""
        return {name: shape for name, shape, _ in self.parameters}

    @property
    def stored_shapes(self) -> dict[str, tuple[int, ...]]:
        """What the run's checkpoints hold: the manifest's tensors, each with its moments if trained."""
        return {name: shape for name, shape, role in self.parameters if role.stored}

    @property
    def stored_names(self) -> frozenset[str]:
        return frozenset(name for name, _, role in self.parameters if role.stored)

    @property
    def trained_names(self) -> frozenset[str]:
        return frozenset(name for name, _, role in self.parameters if role.trained)

    @property
    def frozen_names(self) -> frozenset[str]:
        return frozenset(name for name, _, role in self.parameters if not role.trained)

    @property
    def has_frozen(self) -> bool:
        return any(not role.trained for _, _, role in self.parameters)

    def count(self, trained: bool) -> int:
        """How many elements the trained (or frozen) parameters hold."""
        total = 0
        for _, shape, role in self.parameters:
            if role.trained == trained:
                size = 1
                for dim in shape:
                    size *= dim
                total += size
        return total


def full_training(model: ModelConfig) -> ParameterRoles:
    """Every parameter of the model trained and stored: what a run without a converter has."""
    return ParameterRoles(tuple((name, tuple(shape), TRAINED) for name, shape in parameter_shapes(model).items()))
