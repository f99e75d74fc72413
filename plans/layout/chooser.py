"""Choose a parallel layout for the ranks a cluster has now, and say why.

Used by elastic recovery (whatever ranks remain after a failure) and by `rayshard plan layout`.
Rules, in order of preference:
1. Every hard constraint holds: tp divides the kv heads, ffn and vocabulary and fits in a node
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

from plans.errors import ConfigError
from plans.layout.parallel_layout import PARALLEL_DEGREES, ParallelLayout
from plans.training.model_spec import ModelConfig, parameter_count

BYTES_PER_PARAM_STATE = 16  # fp32 parameter + gradient + two AdamW moments


@dataclass(frozen=True)
class Workload:
    global_batch: int
    seq_len: int
    microbatches: int = 1
    precision: str = "fp32"  # "bf16": bf16 compute over float32 master state
    ac: str = "none"  # activation checkpointing: "none", "full" or "selective"


@dataclass(frozen=True)
class MemoryEstimate:
    model_state: float
    activations: float
    assumes: str = "fp32, no activation recomputation"

    @property
    def total(self) -> float:
        return self.model_state + self.activations


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
        return "\n".join(lines + [f"- {reason}" for reason in self.reasons])


def estimate_memory(model: ModelConfig, layout: ParallelLayout, work: Workload) -> MemoryEstimate:
    """A deliberately simple upper-ish estimate.

    Model state: 16 bytes per parameter (float32 weight, gradient and two AdamW moments, in bf16
    runs too: the master state stays float32), split over tp and pp, and over fsdp for the
    sharded part. Where FSDP2 wraps the model (data ranks > 1, and every bf16 run:
    `actors/model/precision.py`) it also holds working copies of parameters in the compute dtype
    (bf16 on top of the float32 master): one transformer block at a time plus the root's
    embedding, final norm and head (FSDP2 keeps the root gathered from forward to backward), or
    the whole stage under a pipeline (stages keep their parameters gathered across microbatches).
    Activations: per layer and token, about 12 dim + 3 ffn values kept for the backward (norms,
    qkv, attention output, SwiGLU), in the compute dtype; with full AC only each block's input
    (dim values) plus one block being recomputed; with selective AC the matmul and attention
    outputs (about 5 dim + 2 ffn) plus the block input. Then the microbatches in flight (up to
    pp for 1F1B-like schedules) over the layers a stage holds, and the last stage's logits
    (float32 for the loss, plus their gradient).
    """
    itemsize = 2 if work.precision == "bf16" else 4
    params = parameter_count(model)
    per_model_shard = params / (layout.tp * layout.pp)
    root = (model.vocab_size * model.dim * (1 if model.tie_embeddings else 2) + model.dim) / layout.tp
    block = (params / layout.tp - root) / model.n_layers
    gathered = 0.0
    if layout.data_parallel_size > 1 or work.precision == "bf16":  # FSDP2's working copies
        gathered = itemsize * (per_model_shard if layout.pp > 1 else block + root)
    model_state = BYTES_PER_PARAM_STATE * per_model_shard / layout.fsdp + gathered
    rows = work.global_batch // layout.data_parallel_size // work.microbatches
    tokens = rows * work.seq_len
    whole_block = itemsize * tokens * (12 * model.dim + 3 * model.ffn_dim) / layout.tp
    block_input = itemsize * tokens * model.dim
    in_flight = min(layout.pp, work.microbatches) if layout.pp > 1 else 1
    layers_per_stage = -(-model.n_layers // layout.pp)
    if work.ac == "full":
        kept = (block_input * layers_per_stage) * in_flight + whole_block
    elif work.ac == "selective":
        kept = (itemsize * tokens * (5 * model.dim + 2 * model.ffn_dim) / layout.tp + block_input) * layers_per_stage * in_flight
    else:
        kept = whole_block * layers_per_stage * in_flight
    logits = (itemsize + 4 + 4) * tokens * model.vocab_size / layout.tp  # logits, their float32 copy for the loss, gradient
    if work.precision != "bf16":
        logits = 8 * tokens * model.vocab_size / layout.tp  # the float32 logits are the copy
    recompute = {"none": "no activation recomputation", "full": "full activation checkpointing",
                 "selective": "selective activation checkpointing"}[work.ac]
    return MemoryEstimate(model_state, kept + logits, f"{work.precision}, {recompute}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_candidates(model: ModelConfig, ranks_per_node: int) -> list[int]:
    return [t for t in _divisors(model.n_kv_heads)
            if model.ffn_dim % t == 0 and model.vocab_size % t == 0 and t <= ranks_per_node]


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
    needed = prod(v for k, v in pinned.items() if k in PARALLEL_DEGREES)
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
                    layout = ParallelLayout(dp=data // fsdp, fsdp=fsdp, tp=tp, pp=pp, vpp=vpp if pp > 1 else 1)
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
        reasons.append("no model parallelism needed: the model state fits on every data rank")
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
    if layout.fsdp > 1:
        reasons.append(f"fsdp={layout.fsdp}: full replicas do not fit, so model state is sharded over {layout.fsdp} ranks")
    elif layout.dp > 1:
        reasons.append(f"dp={layout.dp}: replicas fit, and replicated data parallelism communicates least")
    return reasons
