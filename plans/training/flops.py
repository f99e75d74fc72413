"""Model FLOPs per token and the device peaks MFU is measured against (torchtitan's way).

FLOPs per token = 6 x (parameters - embedding parameters) + 12 x layers x heads x head_dim x
sequence length: the forward and backward matmuls of every non-embedding weight, plus attention's
scores and weighted sums (torchtitan's `get_num_flop_per_token`, now `get_nparams_and_flops`).
Embedding parameters are excluded as torchtitan excludes them (it subtracts the parameters of its
`nn.Embedding` children): the lookup does no matmul. The untied LM head is a matmul and counts;
with tied embeddings the head shares the embedding's weight, which torchtitan counts once and
subtracts, so the head's matmul drops out with it, and here too. torchtitan's head width is
dim // n_heads; ours is the configured head_dim, which equals it except in families that set it
apart (Qwen3). These are model FLOPs: activation recomputation is work the hardware does on top,
and MFU does not count it. A mixture of experts counts the parameters a token runs through: the
routed experts' by experts_per_token / n_experts (each token meets top-k of them), the router and
the shared expert whole (torchtitan's `nparams_sparse_active` for its MoE models); counting every
expert would put moe-small's FLOPs, and so its MFU, 1.9x too high.

With a frozen base (a LoRA run: its parameter roles, `plans/training/parameter_roles.py`) a frozen
weight costs its forward and its input-gradient matmuls, 4 FLOPs per token, not 6 (no weight
gradient), and the trained adapters 6 each; the first layer's input gradients, which no trained
parameter below needs, are counted all the same (a small overcount, as the LM head's is).
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass

from rayshard.plans.training.model_spec import EXPERT_TENSORS, ModelConfig, parameter_shapes

# Dense peak TFLOP/s per device, (bf16, fp32) (fp32 without TF32, torch's default for matmuls).
# Longer names first: "H100 NVL" and "H100 PCIe" must not match the SXM row.
PEAK_TFLOPS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.4, 66.9),
    ("H100 NVL", 835.0, 60.0),
    ("H100 PCIe", 756.0, 51.2),
    ("H100", 989.4, 66.9),  # SXM
    ("A100", 312.0, 19.5),
)


def active_parameters(model: ModelConfig) -> float:
    """Parameters one token's forward runs through: all of a dense model's; of an MoE model's
    routed experts, top-k of n_experts (the stacked expert tensors hold every expert)."""
    routed_share = model.experts_per_token / model.n_experts if model.is_moe else 1.0
    return sum(math.prod(shape) * (routed_share if fnmatch.fnmatchcase(name, EXPERT_TENSORS) else 1.0)
               for name, shape in parameter_shapes(model).items())


def flops_per_token(model: ModelConfig, seq_len: int, trained_parameters: int | None = None) -> float:
    """trained_parameters: a run that freezes the model's own weights trains only these (its
    adapters); None: every weight trains."""
    # Lookups, not matmuls: the token embedding, and GPT-2's learned positions.
    embedding = model.vocab_size * model.dim + (model.max_seq_len * model.dim if model.position_embedding == "learned" else 0)
    attention = 12.0 * model.n_layers * model.n_heads * model.head_dim * seq_len
    weights = active_parameters(model) - embedding
    if trained_parameters is None:
        return 6.0 * weights + attention
    return 4.0 * weights + 6.0 * trained_parameters + attention


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The device's dense peak for `precision`; None for a CPU or a device not in the table."""
    for name, bf16, fp32 in PEAK_TFLOPS:
        if name.lower() in device_name.lower():
            return bf16 if precision == "bf16" else fp32
    return None


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float  # the whole job's
    tokens_per_s_per_rank: float  # per device (every rank, tp and pp peers included, as torchtitan counts)
    tflops_per_rank: float
    mfu: float | None  # None where the device has no known peak (a CPU)

    def describe(self) -> str:
        mfu = f"mfu {self.mfu:.1%}" if self.mfu is not None else "mfu n/a"
        return (f"{self.tokens_per_s:,.0f} tok/s ({self.tokens_per_s_per_rank:,.0f}/rank) | "
                f"{self.tflops_per_rank:.3g} TFLOP/s/rank | {mfu}")


def throughput(model: ModelConfig, seq_len: int, tokens: int, seconds: float, world_size: int,
               device_name: str, precision: str, trained_parameters: int | None = None,
               computed_tokens: int | None = None) -> Throughput:
    """`tokens` trained on in `seconds` by `world_size` ranks (`trained_parameters`: as in
    `flops_per_token`). computed_tokens: the positions the devices ran (None: `tokens`); padded
    SFT and DPO rows run more positions than they hold tokens, and MFU counts the FLOPs executed,
    padding included, where tokens/s counts only the tokens (decision 203)."""
    per_rank = tokens / seconds / world_size
    computed = tokens if computed_tokens is None else computed_tokens
    tflops = computed / seconds / world_size * flops_per_token(model, seq_len, trained_parameters) / 1e12
    peak = peak_tflops(device_name, precision)
    return Throughput(tokens / seconds, per_rank, tflops, tflops / peak if peak else None)
