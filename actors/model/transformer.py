"""Llama-style decoder, written as single-device code.

Parallelism is applied from outside (`actors/parallel/parallelize.py`). The code never assumes how many
heads or hidden units it holds: it reads them off the shapes it receives, so a tensor-parallel
shard (a contiguous row block of the fused weights, see `plans/training/model_spec.py`) runs unchanged.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rayshard.actors.model.feed_forward import FeedForward
from rayshard.actors.model.gelu_mlp import GeluFeedForward
from rayshard.actors.model.local_ops import rms_norm
from rayshard.actors.model.moe import MoEFeedForward
from rayshard.actors.model.norms import LayerNorm, RMSNormPlusOne
from rayshard.actors.model.rope import apply_rope, rope_tables
from rayshard.plans.training.model_spec import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A plain function of local tensors; under sequence parallelism it runs on the sequence
        # shards through local_map (actors/model/local_ops.py).
        return rms_norm(x, self.weight, self.eps)


def make_norm(config: ModelConfig) -> nn.Module:
    """The norm around each sublayer and at the end: RMSNorm, GPT-2's LayerNorm with a bias, or
    Gemma's (1 + weight) RMSNorm."""
    if config.norm == "layernorm":
        return LayerNorm(config.dim, config.norm_eps)
    if config.norm == "rmsnorm_plus_one":
        return RMSNormPlusOne(config.dim, config.norm_eps)
    return RMSNorm(config.dim, config.norm_eps)


def make_head_norm(config: ModelConfig) -> nn.Module:
    """The per-head q/k norm over head_dim (`parameter_shapes` gives it a weight only)."""
    norm = RMSNormPlusOne if config.norm == "rmsnorm_plus_one" else RMSNorm
    return norm(config.head_dim, config.norm_eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.head_dim = config.head_dim
        self.heads_per_group = config.heads_per_group
        # Gemma 2 and 3 alternate sliding and full layers (ModelConfig.layer_types).
        self.sliding_window = config.sliding_window if config.is_sliding_layer(layer) else None
        # Gemma: scores scaled by query_pre_attn_scalar ** -0.5 (None: SDPA's head_dim ** -0.5),
        # and Gemma 2's scores soft-capped before the mask.
        self.scale = config.query_pre_attn_scalar ** -0.5 if config.query_pre_attn_scalar is not None else None
        self.softcap = config.attn_softcap
        qkv_rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.qkv = nn.Linear(config.dim, qkv_rows, bias=config.qkv_bias)  # Qwen2's q/k/v biases
        # Qwen3, Gemma 3: each query and key head is RMS-normalised over head_dim before RoPE
        # (Gemma's (1 + weight) form with Gemma's norms; an RMSNorm, weight only, otherwise).
        self.q_norm = make_head_norm(config) if config.qk_norm else None
        self.k_norm = make_head_norm(config) if config.qk_norm else None
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=config.wo_bias)  # GPT-2's c_proj bias

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [batch, seq, heads, head_dim], k and v [batch, seq, kv_heads, head_dim] (a LoRA
        converter adds its deltas here, `actors/model/lora.py`)."""
        batch, seq, _ = x.shape
        # [.., groups, heads_per_group + 2, head_dim]: per kv group, its q heads then k then v.
        qkv = self.qkv(x).view(batch, seq, -1, self.heads_per_group + 2, self.head_dim)
        # split, not indexing: an index's backward zero-fills the whole fused gradient once per
        # piece; split's backward is one concatenation (bench/RESULTS.md, throughput).
        q, k, v = qkv.split([self.heads_per_group, 1, 1], dim=-2)
        return q.reshape(batch, seq, -1, self.head_dim), k.squeeze(-2), v.squeeze(-2)

    def project_out(self, heads: torch.Tensor) -> torch.Tensor:
        return self.wo(heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.project_qkv(x)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:  # None: learned positions (GPT-2), added to the embedding instead
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.softcap is not None:
            out = softcapped_attention(q, k, v, self.scale, self.softcap, self.sliding_window)
        elif self.sliding_window is not None and seq > self.sliding_window:
            mask = sliding_window_mask(seq, self.sliding_window, x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, scale=self.scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=self.scale)
        return self.project_out(out.transpose(1, 2).reshape(batch, seq, -1))


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, softcap: float,
                         window: int | None) -> torch.Tensor:
    """Gemma 2's attention: scores soft-capped to (-softcap, softcap) before the mask, which no
    fused kernel computes (SDPA has no score hook), so written out as transformers' eager
    attention computes it, op for op: q [batch, heads, seq, head_dim], k and v [batch, kv_heads,
    seq, head_dim]; the softmax in float32. It holds the [batch, heads, seq, seq] scores."""
    seq = q.shape[2]
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # q heads grouped per kv head
    scores = torch.matmul(q, k.transpose(2, 3)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    scores = torch.tanh(scores / softcap) * softcap
    allowed = (sliding_window_mask(seq, window, q.device) if window is not None
               else torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril())
    weights = F.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def sliding_window_mask(seq: int, window: int, device) -> torch.Tensor:
    """[seq, seq], True where query i may attend key j: j <= i and i - j < window (Mistral's
    sliding window, as transformers masks it)."""
    positions = torch.arange(seq, device=device)
    distance = positions[:, None] - positions[None, :]
    return (distance >= 0) & (distance < window)


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = make_norm(config)
        self.attention = Attention(config, layer)
        # Gemma's sandwich: each sublayer's output normalised again before the residual add.
        # Registered in `parameter_shapes`' order (post_ffn_norm before the feed-forward's weights).
        self.post_attention_norm = make_norm(config) if config.post_norms else None
        self.ffn_norm = make_norm(config)
        self.post_ffn_norm = make_norm(config) if config.post_norms else None
        self.feed_forward = (MoEFeedForward(config) if config.is_moe_layer(layer)
                             else FeedForward(config.dim, config.ffn_dim) if config.mlp == "swiglu"
                             else FeedForward(config.dim, config.ffn_dim, "gelu_tanh") if config.mlp == "geglu_tanh"
                             else GeluFeedForward(config.dim, config.ffn_dim, config.mlp, config.mlp_bias))

    def forward(self, x, cos, sin):
        attended = self.attention(self.attention_norm(x), cos, sin)
        if self.post_attention_norm is not None:
            attended = self.post_attention_norm(attended)
        x = x + attended
        fed = self.feed_forward(self.ffn_norm(x))
        if self.post_ffn_norm is not None:
            fed = self.post_ffn_norm(fed)
        return x + fed


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        # GPT-2's learned absolute positions, added to the token embedding (no RoPE then).
        self.pos_embeddings = (nn.Embedding(config.max_seq_len, config.dim) if config.position_embedding == "learned"
                               else None)
        # A ModuleDict keyed by the global layer index keeps parameter names global when a
        # pipeline stage holds only some layers.
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config, i) for i in range(config.n_layers)})
        self.norm = make_norm(config)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # How many ranks split the residual stream over the sequence (sequence parallelism sets
        # it): a later pipeline stage receives one shard but needs RoPE for the whole sequence.
        self.sequence_shards = 1

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Tokens [batch, seq] -> logits; a pipeline stage (`actors/model/stage.py`) may lack the
        embedding (it then takes the residual stream [batch, seq, dim]) or the head (it then
        returns the residual stream)."""
        seq = inputs.shape[1] if self.tok_embeddings is not None else inputs.shape[1] * self.sequence_shards
        config = self.config
        tables = {"global": (None, None)}
        if config.position_embedding == "rope":
            tables["global"] = rope_tables(seq, config.head_dim, config.rope_theta, inputs.device, config.rope_scaling,
                                           config.max_seq_len)
            if config.rope_local_theta is not None:  # Gemma 3's sliding layers: their own base, no scaling
                tables["local"] = rope_tables(seq, config.head_dim, config.rope_local_theta, inputs.device, None,
                                              config.max_seq_len)
        h = self.tok_embeddings(inputs) if self.tok_embeddings is not None else inputs
        if self.tok_embeddings is not None and config.embedding_scale:
            h = h * embedding_scale(config.dim, h.dtype)
        if self.pos_embeddings is not None:  # the first stage's, like the token embedding
            # Positions of the whole sequence; under sequence parallelism the table's style keeps
            # this rank's rows (actors/parallel/parallelize.py, PositionsToSequence).
            h = h + self.pos_embeddings(torch.arange(inputs.shape[1], device=inputs.device))
        for index, layer in self.layers.items():
            cos, sin = tables[config.layer_rope(int(index))]
            h = layer(h, cos, sin)
        if self.output is None:
            return h
        logits = self.output(self.norm(h))
        if config.logit_softcap is not None:  # Gemma 2: logits squashed into (-cap, cap)
            logits = torch.tanh(logits / config.logit_softcap) * config.logit_softcap
        return logits


def embedding_scale(dim: int, dtype: torch.dtype) -> float:
    """Gemma's embedding multiplier: sqrt(dim) as transformers holds it (a float32 buffer) rounded
    to the embedding's dtype (in bf16, sqrt(2304) = 48 exactly, sqrt(3072) becomes 55.5)."""
    return torch.tensor(math.sqrt(dim)).to(dtype).item()


def build_on_meta(config: ModelConfig) -> Transformer:
    """Parameters without storage: each rank materialises only its own shard later."""
    with torch.device("meta"):
        return Transformer(config)
