"""Choose a parallel layout for the ranks a cluster has now, and say why.

Used by elastic recovery (whatever ranks remain after a failure) and by `rayshard plan layout`.
Rules, in order of preference:
1. Every hard constraint holds: tp divides the kv heads and ffn (not the vocabulary, which
   shards unevenly: docs/decisions.md 118) and fits in a node
   (its collectives are per layer and want the fast intra-node links); pp * vpp stages fit the
   layers; data ranks (dp * fsdp) divide the global batch into whole microbatches.
2. The estimated memory per rank fits the budget.
3. The most useful work: ranks used times the pipeline's efficiency m / (m + pp - 1) — a
   pipeline with few microbatches mostly idles, so six ranks as dp2 x pp3 with one
   microbatch do less than four data-parallel ranks.
4. Then the least communication: data parallelism, then FSDP when replicas do not fit, then
   tensor parallelism, then pipeline stages.
Any dimension may be pinned by the user; the others are chosen around it.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod

from rayshard.plans.layout.snapshot_memory import SHARES_PER_RANK, snapshot_host_bytes
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.experts import (ExpertFootprint, check_pinned_ep, exchange_elements, expert_degree,
                                  expert_parameters_per_layer, largest_block)
from rayshard.plans.layout.parallel_layout import PARALLEL_DEGREES, ParallelLayout
from rayshard.plans.training.model_spec import ModelConfig, parameter_count
from rayshard.plans.training.tp_fit import fitting_tp

BYTES_PER_PARAM_STATE = 16  # fp32 parameter + gradient + two AdamW moments
BYTES_PER_SAVED_PARAM = 12  # what a checkpoint keeps of a trained parameter: float32 weight and two AdamW moments
BYTES_PER_FROZEN_PARAM = 4  # a frozen (LoRA base) weight: fp32 (2 bytes in bf16 runs), no gradient, no moments
# What a user may pin: the rank dimensions, and ep (vpp comes from the run's schedule instead).
PINNABLE_DEGREES = (*PARALLEL_DEGREES, "ep")


@dataclass(frozen=True)
class Workload:
    global_batch: int
    seq_len: int
    microbatches: int = 1
    precision: str = "fp32"  # "bf16": bf16 compute over float32 master state
    ac: str = "none"  # activation checkpointing: "none", "full" or "selective"
    # Parameters the optimizer steps when a converter freezes the model's own (a LoRA run's
    # adapters, `ParameterRoles.count(trained=True)`); None: every parameter of the model trains.
    trained_parameters: int | None = None
    snapshots: bool = False  # --snapshot-every > 0: each rank's share of the state is also kept in host memory
    host_budget: bool = True  # the budget is host memory (CPU ranks), so the snapshots' host memory counts in it


@dataclass(frozen=True)
class MemoryEstimate:
    model_state: float
    activations: float
    assumes: str = "fp32, no activation recomputation"
    experts: float = 0.0  # the part of model_state that is an MoE model's expert weights, moments and gradients
    snapshot_host: float = 0.0  # host memory snapshots take per rank (plans/layout/snapshot_memory.py)
    snapshot_in_budget: bool = False  # counted in total: the ranks' budget is host memory

    @property
    def total(self) -> float:
        return self.model_state + self.activations + (self.snapshot_host if self.snapshot_in_budget else 0.0)


@dataclass
class LayoutChoice:
    layout: ParallelLayout
    ranks_available: int
    estimate: MemoryEstimate
    budget_bytes: float
    reasons: list[str] = field(default_factory=list)

    def explain(self) -> str:
        gib = 2 ** 30
        lines = [f"layout {self.layout} ({self.layout.describe()}): {self.layout.world_size} of {self.ranks_available} ranks",
                 f"memory per rank ~ {self.estimate.total / gib:.2f} GiB (model state {self.estimate.model_state / gib:.2f}, "
                 f"activations {self.estimate.activations / gib:.2f}) of {self.budget_bytes / gib:.2f} GiB budget, "
                 f"assuming {self.estimate.assumes}"]
        if self.estimate.experts:
            experts = self.estimate.experts  # MiB where GiB would print 0.00 (moe-tiny's experts)
            size = f"{experts / gib:.2f} GiB" if experts >= 0.01 * gib else f"{experts / 2**20:.2f} MiB"
            lines[-1] += f"; expert weights, gradients and moments {size} of the model state"
        if self.estimate.snapshot_host:
            where = "counted in the budget (CPU ranks)" if self.estimate.snapshot_in_budget else "host memory, besides the device budget"
            lines.append(f"snapshots in memory ~ {self.estimate.snapshot_host / gib:.2f} GiB per rank, {where}: "
                         f"{SHARES_PER_RANK} copies of the rank's share (two staging buffers and the keepers' two copies "
                         "of the committed snapshot and of two being written)")
        return "\n".join(lines + [f"- {reason}" for reason in self.reasons])


def estimate_memory(model: ModelConfig, layout: ParallelLayout, work: Workload) -> MemoryEstimate:
    """A deliberately simple upper-ish estimate.

    Model state: 16 bytes per parameter (float32 weight, gradient and two AdamW moments, in bf16
    runs too: the master state stays float32), split over tp and pp, and over fsdp for the
    sharded part. Where FSDP2 wraps the model (data ranks > 1, and every bf16 run:
    `actors/parallel/precision.py`) it also holds working copies of parameters in the compute dtype
    (bf16 on top of the float32 master): the largest transformer block at a time plus the root's
    embedding, final norm and head (FSDP2 keeps the root gathered from forward to backward), or
    the whole stage under a pipeline (stages keep their parameters gathered across microbatches).
    Activations: per layer and token, about 12 dim + 3 ffn values kept for the backward (norms,
    qkv, attention output, SwiGLU), in the compute dtype; with full AC only each block's input
    (dim values) plus one block being recomputed; with selective AC the matmul and attention
    outputs (about 5 dim + 2 ffn) plus the block input. Then the microbatches in flight (up to
    pp for 1F1B-like schedules) over the layers a stage holds, and the last stage's logits
    (float32 for the loss, plus their gradient).
    Snapshots (`work.snapshots`): SHARES_PER_RANK copies of the rank's saved share (12 bytes per
    trained parameter: weight and moments) in host memory, counted in total when the budget is
    host memory (CPU ranks), else reported beside it (plans/layout/snapshot_memory.py).
    The vocabulary counts as the fullest tp rank holds it: ceil(vocab / tp) rows of the
    embedding, head and logits where tp does not divide it (decision 118).

    Mixture of experts (`plans/layout/experts.py`): the stacked experts of the fullest stage's
    MoE layers are E * 3 * expert_ffn * dim / (tp * fsdp) parameters of state per rank under
    either ep. Under ep = 1 FSDP2 gathers all E (/ tp) with their block; under ep they are never
    gathered, but in bf16 each MoE layer's forward casts the rank's E/ep experts and the cast
    lives until that layer's backward (per microbatch in flight; one layer at a time under AC,
    which recomputes it). An MoE layer keeps per token 12 dim + 3 shared_ffn + 3 k expert_ffn
    values (/ tp, as above) plus 2 k dim whole on every tp rank: the k routed copies going into
    the experts and the k results coming back, the payloads of the two all-to-alls under ep.
    Under ep one layer's receive buffers (2 k dim per token) come on top, once. Routing is taken
    as balanced (docs/decisions.md 76); the router's E scores per token are left out.
    """
    itemsize = 2 if work.precision == "bf16" else 4
    params = parameter_count(model)
    experts = ExpertFootprint.of(model, layout)
    other_shard = (params - expert_parameters_per_layer(model) * len(model.moe_layers)) / (layout.tp * layout.pp)
    vocab_rows = -(-model.vocab_size // layout.tp)  # the first tp ranks' share, torch.chunk's cut
    root = vocab_rows * model.dim * (1 if model.tie_embeddings else 2) + model.dim / layout.tp
    if model.is_moe:
        block = largest_block(model, with_experts=layout.ep == 1) / layout.tp
    else:  # a user model's blocks need not be named layers.N; every block is alike
        block = (params / layout.tp - root) / model.n_layers
    rows = work.global_batch // layout.data_parallel_size // work.microbatches
    tokens = rows * work.seq_len
    in_flight = min(layout.pp, work.microbatches) if layout.pp > 1 else 1
    gathered = 0.0
    if layout.data_parallel_size > 1 or work.precision == "bf16":  # FSDP2's working copies
        stage = other_shard + experts.gathered_per_layer * experts.layers
        gathered = itemsize * (stage if layout.pp > 1 else block + root)
    if layout.ep > 1 and work.precision == "bf16" and experts.layers:  # the experts' own casts (above)
        gathered += itemsize * experts.local_per_layer * (experts.layers * in_flight if work.ac == "none" else 1)
    state = BYTES_PER_PARAM_STATE * other_shard
    if work.trained_parameters is not None:  # the model's own parameters frozen: a weight each, plus the adapters' state
        frozen = BYTES_PER_FROZEN_PARAM // 2 if work.precision == "bf16" else BYTES_PER_FROZEN_PARAM
        state = (frozen * params + BYTES_PER_PARAM_STATE * work.trained_parameters) / (layout.tp * layout.pp)
    model_state = state / layout.fsdp + BYTES_PER_PARAM_STATE * experts.state + gathered
    if work.trained_parameters is not None:  # a LoRA run's checkpoints keep its adapters only
        saved = BYTES_PER_SAVED_PARAM * work.trained_parameters / (layout.tp * layout.pp * layout.fsdp)
    else:  # an upper bound: under dp a replica may save less than its whole share
        saved = BYTES_PER_SAVED_PARAM * (other_shard / layout.fsdp + experts.state)
    snapshot_host = snapshot_host_bytes(saved) if work.snapshots else 0.0
    kept = _activations_kept(model, layout, work.ac, itemsize * tokens, in_flight, experts.layers)
    logits = (itemsize + 4 + 4) * tokens * vocab_rows  # logits, their float32 copy for the loss, gradient
    if work.precision != "bf16":
        logits = 8 * tokens * vocab_rows  # the float32 logits are the copy
    recompute = {"none": "no activation recomputation", "full": "full activation checkpointing",
                 "selective": "selective activation checkpointing"}[work.ac]
    routing = ", balanced routing" if model.is_moe else ""
    return MemoryEstimate(model_state, kept + logits, f"{work.precision}, {recompute}{routing}",
                          experts=BYTES_PER_PARAM_STATE * experts.state, snapshot_host=snapshot_host,
                          snapshot_in_budget=work.snapshots and work.host_budget)


def _activations_kept(model: ModelConfig, layout: ParallelLayout, ac: str, token_bytes: float, in_flight: int,
                      moe_layers: int) -> float:
    """What the fullest stage's layers keep for their backward (estimate_memory says what).
    token_bytes: tokens of a microbatch times the compute dtype's size."""
    k, tp = model.experts_per_token, layout.tp
    dense_layer = token_bytes * (12 * model.dim + 3 * model.ffn_dim) / tp
    moe_layer = token_bytes * ((12 * model.dim + 3 * model.shared_expert_ffn_dim + 3 * k * model.expert_ffn_dim) / tp
                               + 2 * k * model.dim)
    block_input = token_bytes * model.dim
    layers = -(-model.n_layers // layout.pp)
    dense_layers = layers - moe_layers
    if ac == "full":
        largest = max(dense_layer if dense_layers else 0.0, moe_layer if moe_layers else 0.0)
        kept = block_input * layers * in_flight + largest
    elif ac == "selective":
        dense_kept = token_bytes * (5 * model.dim + 2 * model.ffn_dim) / tp + block_input
        moe_kept = token_bytes * ((5 * model.dim + 2 * model.shared_expert_ffn_dim + 2 * k * model.expert_ffn_dim) / tp
                                  + k * model.dim) + block_input  # the experts' down outputs are matmul outputs too
        kept = (dense_kept * dense_layers + moe_kept * moe_layers) * in_flight
    else:
        kept = (dense_layer * dense_layers + moe_layer * moe_layers) * in_flight
    if layout.ep > 1 and moe_layers:  # one layer's all-to-all receive buffers, tokens and results
        kept += 2 * token_bytes * k * model.dim
    return kept


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_candidates(model: ModelConfig, ranks_per_node: int) -> list[int]:
    # Every size tp must divide (heads, hidden units, experts'), and within a node.
    return [t for t in fitting_tp(model) if t <= ranks_per_node]


def pinned_ranks(pinned: dict[str, int]) -> int:
    """Ranks the pinned dimensions need. A pinned ep > 1 pins fsdp to it (ep borrows exactly the
    fsdp ranks), so it counts where fsdp itself is not pinned."""
    ranks = prod(value for name, value in pinned.items() if name in PARALLEL_DEGREES and value)
    ep = pinned.get("ep") or 1
    return ranks * ep if ep > 1 and not pinned.get("fsdp") else ranks


def choose_layout(ranks: int, model: ModelConfig, work: Workload, budget_bytes: float,
                  ranks_per_node: int = 8, pinned: dict[str, int] | None = None, vpp: int = 1,
                  accepts: Callable[[ParallelLayout], bool] | None = None) -> LayoutChoice:
    """The preferred layout on at most `ranks` ranks. Raises ConfigError when nothing fits.

    accepts: the run's own rules beyond the model's and the batch's (elastic passes "the run's
    config validates on this layout": sequence parallelism needs tp > 1, a pipeline order read
    from a file its own pp and vpp, Qwen3's q/k norms tp 1); a layout it refuses is never chosen."""
    if ranks < 1:
        raise ConfigError("ranks", ranks, "need at least one rank", "start at least one worker")
    pinned = {k: v for k, v in (pinned or {}).items() if v}
    check_pinned_ep(model, pinned)
    needed = pinned_ranks(pinned)
    if needed > ranks:  # name the missing ranks, not a memory budget no layout was tried against
        raise ConfigError("layout", ", ".join(f"{k}={v}" for k, v in pinned.items()),
                          f"the pinned dimensions need {needed} ranks but only {ranks} are available",
                          "add ranks (on a CPU cluster, lower --cpus-per-rank), or pin fewer dimensions")
    candidates, leanest, refused = [], None, 0
    for tp in _tp_candidates(model, ranks_per_node):
        for pp in range(1, min(model.n_layers // vpp, ranks) + 1):
            for data in _divisors(work.global_batch):
                if data * tp * pp > ranks or (work.global_batch // data) % work.microbatches:
                    continue
                for fsdp in _divisors(data):
                    ep = 1 if pinned.get("ep") == 1 else expert_degree(model, fsdp)
                    layout = ParallelLayout(dp=data // fsdp, fsdp=fsdp, tp=tp, pp=pp, vpp=vpp if pp > 1 else 1, ep=ep)
                    if any(getattr(layout, k) != v for k, v in pinned.items()):
                        continue
                    if accepts is not None and not accepts(layout):
                        refused += 1
                        continue
                    estimate = estimate_memory(model, layout, work)
                    if leanest is None or estimate.total < leanest.total:
                        leanest = estimate
                    if estimate.total <= budget_bytes:
                        useful = layout.world_size * work.microbatches / (work.microbatches + pp - 1)
                        candidates.append(((-round(useful, 9), pp, tp, fsdp), layout, estimate))
    if not candidates:
        pins = f" with {pinned}" if pinned else ""
        if leanest is not None:
            leanest_text = f"the leanest valid layout needs ~{leanest.total / 2**30:.2f} GiB per rank"
        elif refused:
            leanest_text = f"the run's settings refuse all {refused} layouts that meet the model and the batch"
        else:
            leanest_text = "no layout meets the model's constraints and the batch divisibility at all"
        raise ConfigError("layout", f"{ranks} ranks",
                          f"no layout of up to {ranks} ranks{pins} fits {budget_bytes / 2**30:.2f} GiB per rank ({leanest_text})",
                          "add ranks or memory, shorten sequences or batches, use more microbatches, or unpin dimensions")
    _, layout, estimate = min(candidates, key=lambda c: c[0])
    return LayoutChoice(layout, ranks, estimate, budget_bytes, _reasons(layout, ranks, model, work, budget_bytes, ranks_per_node, pinned))


def _reasons(layout, ranks, model, work, budget, ranks_per_node, pinned) -> list[str]:
    reasons = []
    if pinned:
        reasons.append(f"pinned by you: {', '.join(f'{k}={v}' for k, v in pinned.items())}")
    if layout.world_size < ranks:
        reasons.append(f"uses {layout.world_size} of {ranks} ranks: layouts on more ranks either do not divide the global "
                       f"batch {work.global_batch} into whole microbatches ({work.microbatches}) per data rank, break the "
                       f"model's constraints, or need pipeline stages that {work.microbatches} microbatch(es) would leave idle")
    simplest = ParallelLayout(dp=layout.data_parallel_size * layout.tp * layout.pp)
    if layout.tp == 1 and layout.pp == 1:
        reasons.append("no tensor or pipeline parallelism needed: the model state fits "
                       + ("on every data rank" if layout.fsdp == 1 else f"once sharded over the {layout.fsdp} fsdp ranks"))
    else:
        if layout.tp > 1:
            reasons.append(f"tp={layout.tp}: smaller degrees do not fit the budget (tp stays within a node of {ranks_per_node} "
                           f"ranks and divides the {model.n_kv_heads} kv heads)")
        if layout.pp > 1:
            efficiency = work.microbatches / (work.microbatches + layout.pp - 1)
            reasons.append(f"pp={layout.pp}: {model.n_layers} layers over {layout.pp} stages; with {work.microbatches} "
                           f"microbatches the pipeline is ~{efficiency:.0%} busy (1F1B bubble)")
        if estimate_memory(model, simplest, work).total > budget:
            reasons.append(f"pure data parallelism would need ~{estimate_memory(model, simplest, work).total / 2**30:.2f} GiB per rank")
    if layout.fsdp > 1 and ("fsdp" in pinned or pinned.get("ep", 1) > 1):  # not the budget's doing
        reasons.append(f"fsdp={layout.fsdp}: as pinned, model state is sharded over {layout.fsdp} ranks")
    elif layout.fsdp > 1:
        reasons.append(f"fsdp={layout.fsdp}: full replicas do not fit, so model state is sharded over {layout.fsdp} ranks")
    elif layout.dp > 1:
        reasons.append(f"dp={layout.dp}: replicas fit, and replicated data parallelism communicates least")
    if model.is_moe:
        reasons.append(_experts_reason(layout, model, work))
    return reasons


def _experts_reason(layout: ParallelLayout, model: ModelConfig, work: Workload) -> str:
    experts = f"the {model.n_experts} experts of each of the {len(model.moe_layers)} MoE layers"
    split = f", each split over tp={layout.tp} by hidden units" if layout.tp > 1 else ""
    if layout.ep > 1:
        tokens = work.global_batch // layout.data_parallel_size // work.microbatches * work.seq_len
        exchange = exchange_elements(model, tokens) * (2 if work.precision == "bf16" else 4) / 2**20
        per_rank = model.n_experts // layout.ep
        return (f"ep={layout.ep}: {experts} are split over the {layout.fsdp} fsdp ranks, {per_rank} "
                f"whole expert{'s' if per_rank > 1 else ''} per rank{split}, never gathered; tokens reach them by all-to-all "
                f"(~{exchange:.2f} MiB each way per MoE layer and microbatch)")
    if layout.fsdp > 1:
        why = ("pinned by you" if model.n_experts % layout.fsdp == 0
               else f"fsdp={layout.fsdp} does not divide the {model.n_experts} experts")
        return f"ep=1 ({why}): {experts} are FSDP-sharded{split} and gathered with their block"
    return f"ep=1: {experts} are on every data rank{split} (no fsdp ranks to split them over)"
