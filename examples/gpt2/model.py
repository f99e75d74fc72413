"""A small GPT-2-style decoder written as plain single-device PyTorch, and its parallelize plan.

Nothing here knows about ranks: rayshard applies tensor, sequence, data and pipeline
parallelism from outside, reading the plan (`plans/training/model_plan.py`). The two things the
code does for rayshard are conventions, not framework calls:
- the blocks live in an nn.ModuleDict keyed by global index ("0".."n-1"), so a pipeline stage
  holding blocks 2..3 still names them `blocks.2...`, and checkpoints stay layout-free;
- the forward skips modules a pipeline stage does not hold (they are None there): without the
  embeddings it takes the residual stream, without the head it returns it.
Attention and the MLP read head counts and widths off the tensors they get, so a tensor-parallel
shard (a block of heads, a block of hidden units) runs the same code.

Initial values follow rayshard's rules by parameter name: `*norm.weight` ones, biases zeros,
everything else normal(0, 0.02), identically on every layout.

The numerics are GPT-2's (tanh GELU = "gelu_new", LayerNorm eps 1e-5, attention scaled by
1/sqrt(head_dim), no dropout), so `tiny_gpt2`'s plan also says how `ckpt export` writes it as
transformers' `GPT2LMHeadModel` (`gpt2_hf_mapping`, `gpt2_hf_config`).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from rayshard.actors.model.user_model import FactoryModel
from rayshard.plans.training.model_plan import ModelPlan
from rayshard.plans.training.tp_plan import COLWISE, GATHER_SEQUENCE, ROWWISE, SEQUENCE_PARALLEL, VOCAB_EMBEDDING, VOCAB_HEAD


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        # Separate q, k, v (GPT-2 fuses them): each is column-parallel on its own, so a tp rank
        # holds whole heads of all three without a reordered fused tensor.
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (layer(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(dim, hidden)
        self.proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads)
        self.mlp_norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT2(nn.Module):
    """positions=False drops the learned positions (what `--sp` needs: see SEQUENCE_PARALLEL_ADDITIONS)."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_seq_len: int, positions: bool = True):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)          # tokens
        self.wpe = nn.Embedding(max_seq_len, dim) if positions else None  # learned positions
        self.blocks = nn.ModuleDict({str(i): Block(dim, heads, 4 * dim) for i in range(layers)})
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)  # untied (user models do not tie yet)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:
            tokens = x
            x = self.wte(tokens)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is None:
            return x
        return self.lm_head(self.norm(x))


# Module-name patterns -> styles. The embedding is vocab-parallel and the head leaves logits
# sharded over the vocabulary, so the built-in loss never gathers them; q/k/v and fc split their
# outputs (heads, hidden units), the two projections their inputs, one all-reduce per pair.
TP_STYLES = {
    "wte": VOCAB_EMBEDDING,
    "blocks.*.attn.q": COLWISE, "blocks.*.attn.k": COLWISE, "blocks.*.attn.v": COLWISE,
    "blocks.*.attn.proj": ROWWISE,
    "blocks.*.mlp.fc": COLWISE,
    "blocks.*.mlp.proj": ROWWISE,
    "lm_head": VOCAB_HEAD,
}
# What --sp adds: the residual-stream norms on sequence shards, the sequence gathered before
# each half's column-parallel matmuls. Only for the model without learned positions: under --sp
# the embedding's output is this rank's sequence shard, and single-device code cannot know which
# positions to add to it, so `tiny_gpt2`'s plan declares no sequence parallelism (--sp is refused).
SEQUENCE_PARALLEL_ADDITIONS = {
    "blocks.*.attn_norm": SEQUENCE_PARALLEL, "blocks.*.mlp_norm": SEQUENCE_PARALLEL, "norm": SEQUENCE_PARALLEL,
    "blocks.*.attn": GATHER_SEQUENCE, "blocks.*.mlp": GATHER_SEQUENCE,
}


# LoRA's target names (`--lora-targets q,v`) as module-name patterns; patterns may be given too.
LORA_TARGETS = {"q": "blocks.*.attn.q", "k": "blocks.*.attn.k", "v": "blocks.*.attn.v", "o": "blocks.*.attn.proj",
                "up": "blocks.*.mlp.fc", "down": "blocks.*.mlp.proj"}


def gpt2_plan(dim: int, vocab: int, max_seq_len: int, positions: bool = True) -> ModelPlan:
    return ModelPlan(tp_styles=TP_STYLES, lora_targets=LORA_TARGETS, sequence_parallel={} if positions else SEQUENCE_PARALLEL_ADDITIONS,
                     blocks="blocks", first_stage=("wte", "wpe") if positions else ("wte",),
                     last_stage=("norm", "lm_head"), hidden_size=dim, vocab_size=vocab, max_seq_len=max_seq_len)


def gpt2_hf_mapping(dim: int) -> list[dict]:
    """Our names -> GPT2LMHeadModel's, as rules written as data (`plans/transforms/codec.py`).

    GPT-2 fuses q, k, v into one `c_attn` and stores every block Linear as a Conv1D, whose weight
    is [in, out]: the transpose of nn.Linear's [out, in]. So c_attn is q, k, v stacked by rows
    (heads in plain order, no grouping: groups 1) and then transposed; its bias is the three biases
    stacked; the projections are renamed and transposed. Embeddings, norms and the head keep
    their layout."""
    h, ours = "transformer.h.{layer}.", "blocks.{layer}."
    rules: list[dict] = [{"rename": ["wte.weight", "transformer.wte.weight"]},
                         {"rename": ["wpe.weight", "transformer.wpe.weight"]}]
    for leaf in ("weight", "bias"):
        rules += [
            {"rename": [ours + f"attn_norm.{leaf}", h + f"ln_1.{leaf}"]},
            {"concat_rows": [[ours + f"attn.{part}.{leaf}" for part in "qkv"], h + f"attn.c_attn.{leaf}", [dim] * 3, 1]},
            {"rename": [ours + f"attn.proj.{leaf}", h + f"attn.c_proj.{leaf}"]},
            {"rename": [ours + f"mlp_norm.{leaf}", h + f"ln_2.{leaf}"]},
            {"rename": [ours + f"mlp.fc.{leaf}", h + f"mlp.c_fc.{leaf}"]},
            {"rename": [ours + f"mlp.proj.{leaf}", h + f"mlp.c_proj.{leaf}"]},
            {"rename": [f"norm.{leaf}", f"transformer.ln_f.{leaf}"]},
        ]
    rules += [{"transpose": h + f"{conv}.weight"} for conv in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    rules.append({"rename": ["lm_head.weight", "lm_head.weight"]})  # untied: its own tensor
    return rules


def gpt2_hf_config(dim: int, vocab: int, max_seq_len: int, layers: int, heads: int) -> dict:
    """GPT2Config's fields that decide what the weights compute, set to what `GPT2` computes."""
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": vocab, "n_embd": dim,
            "n_layer": layers, "n_head": heads, "n_positions": max_seq_len, "n_inner": 4 * dim,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": False}


def with_gpt2_hf(plan: ModelPlan, layers: int, heads: int) -> ModelPlan:
    """The plan plus its Hugging Face export (only with learned positions: GPT-2 always adds them)."""
    return replace(plan, hf_mapping=gpt2_hf_mapping(plan.hidden_size),
                   hf_config=gpt2_hf_config(plan.hidden_size, plan.vocab_size, plan.max_seq_len, layers, heads))


def tiny_gpt2() -> FactoryModel:
    """Byte-level vocabulary, 4 blocks (so pp=4 can cut it), 4 heads of 16; exports as GPT2LMHeadModel."""
    vocab, dim, max_seq_len = 256, 64, 256
    return FactoryModel(GPT2(vocab, dim, layers=4, heads=4, max_seq_len=max_seq_len),
                        with_gpt2_hf(gpt2_plan(dim, vocab, max_seq_len), layers=4, heads=4))


def tiny_gpt2_without_positions() -> FactoryModel:
    """`tiny_gpt2` with no learned positions (the causal mask alone orders tokens): it trains with --sp."""
    vocab, dim, max_seq_len = 256, 64, 256
    return FactoryModel(GPT2(vocab, dim, layers=4, heads=4, max_seq_len=max_seq_len, positions=False),
                        gpt2_plan(dim, vocab, max_seq_len, positions=False))


def doubled_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A user's own criterion, kept apart from the model: twice the mean cross-entropy. Under tp
    the logits arrive vocab-sharded and it runs under `loss_parallel`, like the built-in one."""
    return 2.0 * F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def tiny_gpt2_doubled_loss() -> FactoryModel:
    """`tiny_gpt2` trained with the user criterion above."""
    made = tiny_gpt2()
    return FactoryModel(made.module, made.plan, loss=doubled_cross_entropy)
