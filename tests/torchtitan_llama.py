"""A Llama with torchtitan's parameter names and its RoPE convention, for the DCP interop tests.

torchtitan's `torchtitan/models/llama3/model/model.py` (not a dependency): separate wq/wk/wv,
feed_forward w1 (gate), w3 (up), w2 (down), nn.RMSNorm norms, and rotary embedding on complex
pairs of ADJACENT elements of each head (`view_as_complex(x.reshape(..., -1, 2))`), where
rayshard and Hugging Face rotate halves. Written here from that description, no rope scaling, so
a test can check that the mapping's row permutation makes both models compute the same logits.

`parallelize` applies torchtitan's own plan shape: TP colwise on wq/wk/wv/w1/w3 and rowwise on
wo/w2, then FSDP2 per block and at the root, on a (dp_shard, tp) mesh.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rayshard.plans.training.model_spec import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x, freqs_cis):
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        q, k = _rotate_adjacent_pairs(q, freqs_cis), _rotate_adjacent_pairs(k, freqs_cis)
        repeat = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


def _rotate_adjacent_pairs(x, freqs_cis):
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs_cis[None, :, None, :]).flatten(3).type_as(x)


def freqs_cis(head_dim: int, seq: int, theta: float) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config.dim, config.ffn_dim)
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(config) for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens):
        freqs = freqs_cis(self.config.head_dim, tokens.shape[1], self.config.rope_theta)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, freqs)
        return self.output(self.norm(h))


def parallelize(model: Transformer, dp_shard: int, tp: int):
    """FSDP2 x TP as torchtitan lays it out (world size dp_shard * tp), on the current gloo group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dp_shard, tp), mesh_dim_names=("dp_shard", "tp"))
    if tp > 1:
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], {
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()})
    if dp_shard > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    return mesh


# ---- our tensors <-> torchtitan's, written by hand (independently of plans/interop/torchtitan.py) ----


def _to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from rotate-half order to adjacent-pair order (torchtitan's adapter does
    this to Hugging Face's q and k: `_reverse_permute`)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def _to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def torchtitan_from_ours(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """One kind of state (weights or a moment) under our names -> torchtitan's names."""
    out, hd, r = {}, config.head_dim, config.heads_per_group
    for name, tensor in state.items():
        if name.endswith("attention.qkv.weight"):
            grouped = tensor.reshape(config.n_kv_heads, r + 2, hd, tensor.shape[1])
            base = name.removesuffix("qkv.weight")
            out[base + "wq.weight"] = _to_pairs(grouped[:, :r].reshape(-1, tensor.shape[1]), config.n_heads)
            out[base + "wk.weight"] = _to_pairs(grouped[:, r].reshape(-1, tensor.shape[1]), config.n_kv_heads)
            out[base + "wv.weight"] = grouped[:, r + 1].reshape(-1, tensor.shape[1]).contiguous()
        elif name.endswith("feed_forward.gate_up.weight"):
            pairs = tensor.reshape(config.ffn_dim, 2, tensor.shape[1])
            base = name.removesuffix("gate_up.weight")
            out[base + "w1.weight"], out[base + "w3.weight"] = pairs[:, 0].contiguous(), pairs[:, 1].contiguous()
        elif name.endswith("feed_forward.down.weight"):
            out[name.replace("down.weight", "w2.weight")] = tensor
        else:
            out[name] = tensor
    return out


def ours_from_torchtitan(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    out, r = {}, config.heads_per_group
    for name, tensor in state.items():
        if name.endswith("attention.wq.weight"):
            base = name.removesuffix("wq.weight")
            q = _to_halves(tensor, config.n_heads).reshape(config.n_kv_heads, r, config.head_dim, -1)
            k = _to_halves(state[base + "wk.weight"], config.n_kv_heads).reshape(config.n_kv_heads, 1, config.head_dim, -1)
            v = state[base + "wv.weight"].reshape(config.n_kv_heads, 1, config.head_dim, -1)
            out[base + "qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, tensor.shape[1])
        elif name.endswith("feed_forward.w1.weight"):
            base = name.removesuffix("w1.weight")
            out[base + "gate_up.weight"] = torch.stack([tensor, state[base + "w3.weight"]], dim=1).reshape(-1, tensor.shape[1])
        elif name.endswith("feed_forward.w2.weight"):
            out[name.replace("w2.weight", "down.weight")] = tensor
        elif not name.endswith(("attention.wk.weight", "attention.wv.weight", "feed_forward.w3.weight")):
            out[name] = tensor
    return out
