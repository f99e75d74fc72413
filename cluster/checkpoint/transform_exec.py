"""Runs one group of a mapping plan (`plans/transforms/mapping.py`) on real tensors."""
from __future__ import annotations

from typing import Callable

import torch

from rayshard.plans.errors import CheckpointError
from rayshard.plans.transforms.mapping import (Add, Cast, ConcatRows, Drop, Group, RegroupRows, Rename, SplitRows, Stack, Transpose,
                                         Unalias, Unstack)


# Called on each tensor of a group the first time its name appears (a source, or a step's output):
# the name and the tensor -> the tensor to go on with. The LoRA merge adds an adapter's delta there,
# where a projection's weight stands alone before a fused export concatenates it with others.
Adjust = Callable[[str, torch.Tensor], torch.Tensor]


def run_group(group: Group, tensors: dict[str, torch.Tensor], adjust: Adjust | None = None) -> dict[str, torch.Tensor]:
    """The group's outputs from its source tensors, applying its steps in order (and `adjust` to
    each name the first time it appears: a Transpose or Cast that keeps a name is not a new one)."""
    state = dict(tensors)
    seen: set[str] = set()

    def adjust_new(names) -> None:
        for name in names:
            if adjust is not None and name in state and name not in seen:
                seen.add(name)
                state[name] = adjust(name, state[name])

    adjust_new(list(state))
    for step in group.steps:
        rule = step.rule
        if isinstance(rule, Rename):
            state[step.outputs[0]] = state.pop(step.inputs[0])
        elif isinstance(rule, SplitRows):
            fused = state.pop(step.inputs[0])
            grouped = fused.reshape(rule.groups, sum(rule.rows), *fused.shape[1:])
            for name, part in zip(step.outputs, torch.split(grouped, list(rule.rows), dim=1)):
                state[name] = part.reshape(-1, *fused.shape[1:]).contiguous()
        elif isinstance(rule, ConcatRows):
            parts = [state.pop(name) for name in step.inputs]
            grouped = [p.reshape(rule.groups, rows, *p.shape[1:]) for p, rows in zip(parts, rule.rows)]
            state[step.outputs[0]] = torch.cat(grouped, dim=1).reshape(-1, *parts[0].shape[1:]).contiguous()
        elif isinstance(rule, RegroupRows):
            tensor = state.pop(step.inputs[0])
            regrouped = tensor.reshape(rule.groups, rule.outer, rule.inner, *tensor.shape[1:]).transpose(1, 2)
            state[step.outputs[0]] = regrouped.reshape(tensor.shape).contiguous()
        elif isinstance(rule, Unstack):  # outputs are in index order (Unstack.apply)
            for name, part in zip(step.outputs, state.pop(step.inputs[0]).unbind(0)):
                state[name] = part.contiguous()
        elif isinstance(rule, Stack):  # inputs are in index order (Stack.apply)
            state[step.outputs[0]] = torch.stack([state.pop(name) for name in step.inputs])
        elif isinstance(rule, Transpose):
            state[step.outputs[0]] = state.pop(step.inputs[0]).transpose(*rule.dims).contiguous()
        elif isinstance(rule, Cast):
            state[step.outputs[0]] = state.pop(step.inputs[0]).to(getattr(torch, rule.to))
        elif isinstance(rule, Drop):
            state.pop(step.inputs[0])
        elif isinstance(rule, Add):
            state[rule.name] = torch.full(rule.shape, rule.fill, dtype=getattr(torch, rule.dtype))
        elif isinstance(rule, Unalias):
            copy = state.pop(rule.name)
            if not torch.equal(copy, state[rule.of]):
                raise CheckpointError(f"{rule.name} should be a tied copy of {rule.of} but holds different values. "
                                      "Fix: import with untied embeddings (tie_word_embeddings false in config.json)")
        else:  # Alias produces no step
            raise CheckpointError(f"no executor for rule {rule!r}")
        adjust_new(step.outputs)
    return {name: state[name] for name in group.outputs}
