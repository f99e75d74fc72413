"""How a layout holds a mixture-of-experts model's experts: which ep a layout gets, and what the
experts cost a rank in memory. The layout chooser's estimate, `plan layout` and elastic recovery
all read these, so the three never disagree about an MoE model.

ep borrows exactly the fsdp ranks (docs/decisions.md 71): under ep = fsdp each rank holds E/ep
whole experts of every MoE layer (split over tp by hidden units), copied over dp; under ep = 1
FSDP2 shards the stacked expert weights with the rest and all-gathers them one block at a time.
Either way a rank's float32 state of the experts is the global experts / (fsdp * tp) — the
difference is what gets gathered (docs/decisions.md 75).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import ModelConfig, check_experts_fit, moe_shapes, parameter_shapes


def expert_degree(model: ModelConfig, fsdp: int) -> int:
    """The ep a layout with this fsdp gets: fsdp itself where the experts split evenly over the
    fsdp ranks (whole experts per rank, no per-block all-gather of every expert), else 1. A dense
    model never gets ep."""
    return fsdp if model.is_moe and fsdp > 1 and model.n_experts % fsdp == 0 else 1


def check_pinned_ep(model: ModelConfig, pinned: dict[str, int]) -> None:
    """A pinned ep is honoured or refused here, in one line, before any layout is tried: it needs
    an MoE model, must divide the experts, and fixes fsdp (ParallelLayout says so if fsdp is
    pinned to another value)."""
    ep = pinned.get("ep", 1)
    if ep > 1:
        check_experts_fit(model, ParallelLayout(fsdp=pinned.get("fsdp", ep), ep=ep))


def expert_parameters_per_layer(model: ModelConfig) -> int:
    """Elements of one MoE layer's stacked experts (gate_up and down; router and shared expert
    are ordinary weights, held like the attention's)."""
    if not model.is_moe:
        return 0
    return sum(prod(shape) for name, shape in moe_shapes(model, "").items() if name.startswith("experts."))


def moe_layers_per_stage(model: ModelConfig, pp: int) -> int:
    """MoE layers on the fullest pipeline stage, MoE layers being spread evenly by the layer cut
    (moe-tiny on pp4: stages 1 and 3 hold one each, so a rank's estimate counts one, not half)."""
    return -(-len(model.moe_layers) // pp) if model.is_moe else 0


@dataclass(frozen=True)
class ExpertFootprint:
    """What a rank holds of the experts, in elements (multiply by bytes per element).

    state: the rank's share of every expert weight of its stage, as held between steps (and so
    its gradient and two AdamW moments): experts / (tp * fsdp).
    gathered_per_layer: what FSDP2 gathers of one MoE layer's experts when the layer runs: all
    E experts (divided by tp) under ep = 1, nothing under ep (the experts stay whole and local).
    local_per_layer: one MoE layer's experts this rank computes with: E/ep of them, / tp."""

    state: float
    gathered_per_layer: float
    local_per_layer: float
    layers: int  # MoE layers on the fullest stage

    @classmethod
    def of(cls, model: ModelConfig, layout: ParallelLayout) -> "ExpertFootprint":
        per_layer = expert_parameters_per_layer(model) / layout.tp
        layers = moe_layers_per_stage(model, layout.pp)
        return cls(state=per_layer * layers / layout.fsdp, gathered_per_layer=per_layer if layout.ep == 1 else 0.0,
                   local_per_layer=per_layer / layout.ep, layers=layers)


def largest_block(model: ModelConfig, with_experts: bool) -> int:
    """Elements of the largest transformer block, its stacked experts left out where FSDP2 does
    not gather them (under ep an MoE block is its attention, router and shared expert)."""
    experts = 0 if with_experts else expert_parameters_per_layer(model)
    blocks: dict[int, int] = {}
    for name, shape in parameter_shapes(model).items():
        if name.startswith("layers."):
            layer = int(name.split(".")[1])
            blocks[layer] = blocks.get(layer, 0) + prod(shape)
    return max(size - (experts if model.is_moe_layer(layer) else 0) for layer, size in blocks.items())


def exchange_elements(model: ModelConfig, tokens: int) -> int:
    """Elements one all-to-all of one MoE layer carries over the ep group: every token's k routed
    copies of width dim (dropless, so exactly this many, however unevenly they land)."""
    return tokens * model.experts_per_token * model.dim
