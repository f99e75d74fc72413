"""Stage carving: a rank builds only its pipeline stages, and shows them as one model.

A stage is the reference Transformer with the layers of other stages removed, the embedding
only on the first stage and the norm and LM head only on the last. Layers stay in a ModuleDict
keyed by their global index, so parameter names stay global (`layers.5.attention.qkv.weight`):
checkpoints are layout-free, and so is initialisation, which seeds by name.

Tied embeddings across stages: the first stage owns `tok_embeddings.weight`; the last stage
holds a copy as its `output.weight`, initialised, loaded and named (`RankStages`) as
`tok_embeddings.weight` and listed among the rank's pipeline copies (`PipelineCopies`), so
checkpoints write it once and the gradient norm counts it once. The pipelined step runner sums the
two copies' gradients every step, so both take identical optimizer steps and stay one logical
parameter.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from rayshard.actors.model.transformer import Transformer, build_on_meta
from rayshard.plans.training.model_plan import ModelPlan
from rayshard.plans.training.model_spec import ModelConfig

TIED_NAME = "tok_embeddings.weight"
TIED_COPY_NAME = "output.weight"


def build_stage_on_meta(config: ModelConfig, layers: range, first: bool, last: bool) -> Transformer:
    """The parts of the model one stage runs, without storage."""
    return carve_stage(build_on_meta(config), config.plan, layers, first, last)


def carve_stage(model: nn.Module, plan: ModelPlan, layers: range, first: bool, last: bool) -> nn.Module:
    """One pipeline stage of any model (its plan says which parts): blocks outside `layers` removed (the ModuleDict keeps
    global indices, so parameter names stay global), the first stage's modules set to None on
    later stages and the last stage's on earlier ones (the forward skips what is None)."""
    blocks = model.get_submodule(plan.blocks)
    for index in list(blocks.keys()):
        if int(index) not in layers:
            del blocks[index]
    for names, keep in ((plan.first_stage, first), (plan.last_stage, last)):
        if keep:
            continue
        for name in names:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, leaf, None)
    return model


def stage_global_names(config: ModelConfig, first: bool, last: bool) -> dict[str, str]:
    """Module name -> global name, where they differ (only the tied copy on the last stage)."""
    if config.tie_embeddings and last and not first:
        return {TIED_COPY_NAME: TIED_NAME}
    return {}


class RankStages:
    """The stages one rank runs, seen as one model with global parameter names.

    Checkpointing and the optimizer need only `named_parameters()` and `parameters()`; the
    interpreter runs each stage module on its own.
    """

    def __init__(self, config: ModelConfig, modules: dict[int, nn.Module], num_stages: int):
        self.modules = dict(sorted(modules.items()))
        self.num_stages = num_stages
        self.tie_embeddings = config.tie_embeddings
        self._names = {stage: stage_global_names(config, stage == 0, stage == num_stages - 1) for stage in self.modules}

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for stage, module in self.modules.items():
            for name, param in module.named_parameters():
                yield self._names[stage].get(name, name), param

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    @property
    def tied_original(self) -> nn.Parameter | None:
        """The first stage's embedding, when this rank runs the first stage of a tied model."""
        if not self.tie_embeddings or 0 not in self.modules:
            return None
        return self.modules[0].tok_embeddings.weight

    @property
    def tied_copy(self) -> nn.Parameter | None:
        """The last stage's copy of the tied embedding, when this rank runs the last stage."""
        last = self.num_stages - 1
        if not self.tie_embeddings or last not in self.modules:
            return None
        return self.modules[last].output.weight


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
