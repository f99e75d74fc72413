"""A mixture-of-experts feed-forward, written as single-device code.

Parallelism is applied from outside, as for the dense model: tensor parallelism splits each
expert's hidden units (`plans/training/tp_plan.py`, EXPERT_* styles), expert parallelism hands
the layer an `ExpertDispatch` that sends tokens to the ranks holding their experts
(`actors/parallel/expert_dispatch.py`). The layer never asks how many experts it holds.

Routing is dropless: every token reaches its k experts whatever their load. A capacity factor
would drop tokens depending on which tokens share a rank's batch, so the same batch would train
differently on two layouts; dropless keeps every layout computing the same function (the price:
all-to-all sizes vary from step to step, and one expert's rank may receive many tokens).

The load-balancing loss is Switch/Mixtral's E * sum_e f_e * P_e (f_e: the share of routing slots
that chose expert e, P_e: the mean router probability of e), taken per sequence and MoE layer and
averaged. transformers computes it over whatever batch it is handed, all layers concatenated; a
batch is cut differently by every layout (data ranks, microbatches, pipeline stages), so the
per-sequence form is the one that gives every layout the same loss and gradients.
"""
from __future__ import annotations

import fnmatch

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from rayshard.actors.model.feed_forward import FeedForward
from rayshard.actors.model.swiglu import gate_up_swiglu
from rayshard.plans.training.model_spec import EXPERT_TENSORS, ModelConfig


def is_expert_parameter(name: str) -> bool:
    """A stacked expert weight: not managed by FSDP under ep > 1, its gradient reduced by the trainer."""
    return fnmatch.fnmatchcase(name, EXPERT_TENSORS)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's piece of a weight (a DTensor under tp or ep); gradients flow back through it."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class StackedLinear(nn.Module):
    """One Linear per expert as one [experts, out, in] weight: row e of dim 0 is expert e."""

    def __init__(self, experts: int, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))


class Experts(nn.Module):
    """SwiGLU experts, stacked. gate_up rows interleave (gate_j, up_j) per hidden unit, as the
    dense feed-forward's do, so a tp shard of dim 1 holds whole hidden units."""

    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.gate_up = StackedLinear(experts, 2 * hidden, dim)
        self.down = StackedLinear(experts, dim, hidden)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """tokens: rows grouped by the rank's experts, counts[e] rows for its e-th expert."""
        # Cast for bf16 under ep, where FSDP (which casts the other weights) does not hold these.
        gate_up = local_part(self.gate_up.weight).to(tokens.dtype).unbind(0)  # unbind: one stack in backward
        down = local_part(self.down.weight).to(tokens.dtype).unbind(0)
        outputs = []
        for rows, gate_up_e, down_e in zip(tokens.split(counts), gate_up, down):
            outputs.append(F.linear(gate_up_swiglu(rows, gate_up_e), down_e))
        return torch.cat(outputs)


class LocalDispatch:
    """Every expert on this rank (ep = 1, tp = 1); `actors/parallel/expert_dispatch.py` has the others."""

    def __call__(self, routed: torch.Tensor, counts: torch.Tensor, experts: Experts,
                 statistics: "RoutingStatistics | None" = None) -> torch.Tensor:
        return experts(routed, counts.tolist())


class _AttachAuxLoss(torch.autograd.Function):
    """Returns `output` unchanged; its backward also gives `aux` the gradient `scale`, as if
    scale * aux had been added to the loss (Megatron's MoEAuxLossAutoScaler). The loss lives on
    the last pipeline stage; the router may live on the first, and this needs no transfer."""

    @staticmethod
    def forward(ctx, output, aux, scale):
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad_output.device), None


class RoutingStatistics:
    """What one layer's router did over a step (reset by the trainer each step): tokens sent to
    each expert, the sum and count of the per-microbatch balance losses, and under ep the bytes
    of tokens entering the forward's all-to-alls (dispatch and return) and of those the part that
    went to other ranks."""

    def __init__(self, experts: int):
        # On the CPU even when the model is built on the meta device: a count, not a parameter.
        self.tokens = torch.zeros(experts, dtype=torch.int64, device="cpu")
        self.aux_sum, self.aux_count = 0.0, 0
        self.exchanged_bytes, self.peer_bytes = 0, 0

    def record_exchange(self, exchanged: int, to_peers: int) -> None:
        self.exchanged_bytes += exchanged
        self.peer_bytes += to_peers

    def record(self, counts: torch.Tensor, aux: torch.Tensor | None) -> None:
        self.tokens += counts.detach().to("cpu")
        if aux is not None:
            self.aux_sum += float(aux.detach())
            self.aux_count += 1

    def reset(self) -> None:
        self.tokens.zero_()
        self.aux_sum, self.aux_count = 0.0, 0
        self.exchanged_bytes, self.peer_bytes = 0, 0


@torch.compiler.disable
def _dispatch_uncompiled(dispatch, routed: torch.Tensor, counts: torch.Tensor, experts: Experts,
                         statistics: RoutingStatistics | None, aux: torch.Tensor | None) -> torch.Tensor:
    """The dispatch and the experts outside torch.compile (`--compile` compiles whole blocks).
    Their shapes are the routing's: rows per expert change every step, dynamo specialises sizes
    0 and 1 whatever its dynamic-shape setting, so a compiled expert loop recompiled for new loads
    until the recompile limit (8) and then ran uncompiled anyway. The collectives and the
    host-side split sizes in between would break the graph there regardless.
    The routing statistics are recorded here too (`statistics` None: not counted): their
    host-side sums (`float(aux)`, the counts copied to the CPU) broke the compiled block's graph
    a second time, with a warning per layer and step."""
    if statistics is not None:
        statistics.record(counts, aux)
    return dispatch(routed, counts, experts, statistics)


def _in_backward() -> bool:
    """True while autograd runs a backward (activation checkpointing recomputes the forward then)."""
    return torch._C._current_graph_task_id() != -1


class MoEFeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_experts, self.top_k = config.n_experts, config.experts_per_token
        self.softmax_scores, self.norm_topk = config.router_scores == "softmax", config.norm_topk
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = Experts(config.n_experts, config.dim, config.expert_ffn_dim)
        shared = config.shared_expert_ffn_dim
        self.shared = FeedForward(config.dim, shared) if shared else None
        self.shared_gate = nn.Linear(config.dim, 1, bias=False) if shared else None
        self.dispatch = LocalDispatch()  # expert parallelism replaces it (actors/parallel/parallelize.py)
        # aux_loss_coef / (MoE layers * microbatches): set by the step runner, which knows the microbatches.
        self.aux_loss_scale = 0.0
        self.statistics = RoutingStatistics(config.n_experts)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores [tokens, experts] in float32, the k weights, the k experts) per token."""
        logits = self.router(tokens).float()
        scores = logits.softmax(dim=-1) if self.softmax_scores else logits.sigmoid()
        weights, chosen = scores.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return scores, weights, chosen

    def balance_loss(self, scores: torch.Tensor, chosen: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
        """E * sum_e f_e * P_e per sequence, averaged over the microbatch's sequences (module doc).
        f_e counts every one of a token's k slots, as transformers' load_balancing_loss_func does."""
        probabilities = scores if self.softmax_scores else scores / scores.sum(dim=-1, keepdim=True)
        mean_probability = probabilities.view(batch, seq, -1).mean(dim=1)
        slots = torch.zeros(batch, self.n_experts, device=scores.device)
        slots.scatter_add_(1, chosen.view(batch, -1), torch.ones(chosen.numel(), device=scores.device).view(batch, -1))
        return self.n_experts * (slots / seq * mean_probability).sum(dim=-1).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        scores, weights, chosen = self.route(tokens)
        flat = chosen.flatten()
        counts = torch.bincount(flat, minlength=self.n_experts)
        # Slots sorted by expert (stable: within an expert, token order), then back.
        order = flat.argsort(stable=True)
        routed = tokens.index_select(0, order // self.top_k)
        # Counted once per microbatch: not in a forward without gradients (a zero-bubble pipeline
        # runs F so when it recomputes the stage later) nor in the recomputation inside a backward.
        counting = self.training and torch.is_grad_enabled() and not _in_backward()
        aux = None
        if self.training and torch.is_grad_enabled() and self.aux_loss_scale:
            aux = self.balance_loss(scores, chosen, batch, seq)
        done = _dispatch_uncompiled(self.dispatch, routed, counts, self.experts,
                                    self.statistics if counting else None, aux)
        done = done.index_select(0, order.argsort())
        out = (done.view(-1, self.top_k, dim) * weights.to(done.dtype).unsqueeze(-1)).sum(dim=1)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(tokens)) * self.shared(tokens)
        out = out.view(batch, seq, dim)
        if aux is not None:
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_scale)
        return out


def moe_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, MoEFeedForward)]


def set_aux_loss_scale(model: nn.Module, config: ModelConfig, microbatches: int) -> None:
    """The balance loss's weight per microbatch: the step's loss is the mean over microbatches
    (`microbatch_loss` divides by their count) and the balance term the mean over MoE layers."""
    scale = config.aux_loss_coef / (len(config.moe_layers) * microbatches) if config.is_moe else 0.0
    for _, layer in moe_layers(model):
        layer.aux_loss_scale = scale
