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
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.model.user_model import FactoryModel
from plans.training.model_plan import ModelPlan
from plans.training.tp_plan import COLWISE, GATHER_SEQUENCE, ROWWISE, SEQUENCE_PARALLEL, VOCAB_EMBEDDING, VOCAB_HEAD


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


def gpt2_plan(dim: int, vocab: int, max_seq_len: int, positions: bool = True) -> ModelPlan:
    return ModelPlan(tp_styles=TP_STYLES, sequence_parallel={} if positions else SEQUENCE_PARALLEL_ADDITIONS,
                     blocks="blocks", first_stage=("wte", "wpe") if positions else ("wte",),
                     last_stage=("norm", "lm_head"), hidden_size=dim, vocab_size=vocab, max_seq_len=max_seq_len)


def tiny_gpt2() -> FactoryModel:
    """Byte-level vocabulary, 4 blocks (so pp=4 can cut it), 4 heads of 16."""
    vocab, dim, max_seq_len = 256, 64, 256
    return FactoryModel(GPT2(vocab, dim, layers=4, heads=4, max_seq_len=max_seq_len), gpt2_plan(dim, vocab, max_seq_len))


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
