"""The reference model's fused layouts: contiguous row blocks are whole head groups / units."""
import pytest
import torch
import torch.nn.functional as F

from rayshard.actors.model.transformer import Attention, FeedForward, Transformer
from rayshard.actors.model.rope import rope_tables
from rayshard.plans.training.model_spec import parameter_count, parameter_shapes, preset


def test_parameters_match_the_spec_with_and_without_tied_embeddings():
    for tie in (False, True):
        config = preset("tiny", tie_embeddings=tie)
        model = Transformer(config)
        assert {n: tuple(p.shape) for n, p in model.named_parameters()} == parameter_shapes(config)
        assert sum(p.numel() for p in model.parameters()) == parameter_count(config)
    assert 10e6 < parameter_count(preset("small")) < 100e6


def test_qkv_row_block_of_one_kv_group_computes_that_groups_heads():
    """A TP rank holding rows of kv group 1 only must produce exactly heads 2..3 of the full
    attention output (n_heads=4, n_kv_heads=2): the fused order is per group, not q|k|v."""
    torch.manual_seed(0)
    config = preset("tiny")
    full = Attention(config)
    x = torch.randn(2, 9, config.dim)
    cos, sin = rope_tables(9, config.head_dim, config.rope_theta)
    # Run only the pre-projection part: capture the input of wo.
    captured = {}
    full.wo.register_forward_hook(lambda m, inp, out: captured.setdefault("full", inp[0]))
    full(x, cos, sin)
    group_rows = (config.heads_per_group + 2) * config.head_dim
    shard = Attention(config)
    shard.qkv.weight = torch.nn.Parameter(full.qkv.weight[group_rows:].clone())
    shard.wo = torch.nn.Linear(config.n_heads * config.head_dim // 2, config.dim, bias=False)
    shard.wo.register_forward_hook(lambda m, inp, out: captured.setdefault("shard", inp[0]))
    shard(x, cos, sin)
    heads = config.heads_per_group * config.head_dim
    torch.testing.assert_close(captured["shard"], captured["full"][..., heads:])
    assert not torch.allclose(captured["shard"], captured["full"][..., :heads])


def test_gate_up_rows_interleave_gate_and_up_per_unit():
    torch.manual_seed(1)
    config = preset("tiny")
    ffn = FeedForward(config.dim, config.ffn_dim)
    x = torch.randn(3, config.dim)
    gate, up = ffn.gate_up.weight[0::2], ffn.gate_up.weight[1::2]
    expected = (F.silu(x @ gate.T) * (x @ up.T)) @ ffn.down.weight.T
    torch.testing.assert_close(ffn(x), expected)
    # The second half of the hidden units as a TP shard: rows [ffn, 2*ffn) and down's columns.
    half = config.ffn_dim // 2
    shard = FeedForward(config.dim, config.ffn_dim)
    shard.gate_up.weight = torch.nn.Parameter(ffn.gate_up.weight[2 * half:].clone())
    shard.down.weight = torch.nn.Parameter(ffn.down.weight[:, half:].clone())
    partial = (F.silu(x @ gate[half:].T) * (x @ up[half:].T)) @ ffn.down.weight[:, half:].T
    torch.testing.assert_close(shard(x), partial)


def _plain_gate_up_swiglu(x, weight):
    """The reference: plain autograd on the fused weight's two row views."""
    return F.silu(x @ weight[0::2].t()) * (x @ weight[1::2].t())


def test_gate_up_swiglu_under_autocast_and_on_one_token():
    """Under autocast the matmuls run in bf16 over float32 inputs: the gradients come back in the
    inputs' dtypes, equal to plain autograd's under the same autocast. A 1-D x is one token."""
    from rayshard.actors.model.swiglu import gate_up_swiglu

    generator = torch.Generator().manual_seed(5)
    x, weight = torch.randn(3, 4, 6, generator=generator), torch.randn(10, 6, generator=generator)
    results = []
    for function in (_plain_gate_up_swiglu, gate_up_swiglu):
        x_leaf, w_leaf = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = function(x_leaf, w_leaf)
        out.float().sum().backward()
        results.append((out, x_leaf.grad, w_leaf.grad))
    (out, grad_x, grad_w), (ours, ours_grad_x, ours_grad_w) = results
    assert ours.dtype == out.dtype == torch.bfloat16 and torch.equal(ours, out)
    assert ours_grad_x.dtype == ours_grad_w.dtype == torch.float32
    torch.testing.assert_close(ours_grad_x, grad_x, rtol=2e-2, atol=2e-2 * float(grad_x.abs().amax()))
    torch.testing.assert_close(ours_grad_w, grad_w, rtol=2e-2, atol=2e-2 * float(grad_w.abs().amax()))
    one = gate_up_swiglu(x[0, 0], weight)
    assert one.shape == (5,) and torch.equal(one, gate_up_swiglu(x[:1, :1], weight).reshape(5))


def test_causal_model_output_does_not_depend_on_future_tokens():
    torch.manual_seed(2)
    model = Transformer(preset("tiny"))
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    torch.testing.assert_close(model(tokens)[:, :8], model(changed)[:, :8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 12, 6), (3, 7, 2, 4), (1, 1, 320, 8), (0, 5, 4, 3)])
def test_gate_up_swiglu_matches_plain_autograd_on_the_interleaved_rows(shape, dtype):
    """The hand-written backward writes each half's weight gradient into its rows of one gradient
    (actors/model/swiglu.py); values must be plain autograd's on the two row views of the fused
    weight (a swapped gate/up, or a gradient into the wrong rows, fails). The forward runs the same
    kernels: bit for bit. The gradients sum the same products in another order (the weight's as
    grad.T @ x where autograd takes (x.T @ grad).T; x's adds the two halves inside one addmm):
    within an ulp or two."""
    from rayshard.actors.model.swiglu import gate_up_swiglu

    batch, tokens, hidden, dim = shape
    generator = torch.Generator().manual_seed(3)
    # Gates and ups of different scales per unit: swapping the halves changes every value.
    scale = (torch.linspace(0.2, 4.0, 2 * hidden) * torch.tensor([1.0, -0.3]).repeat(hidden))[:, None]
    weight = (torch.randn(2 * hidden, dim, generator=generator) * scale).to(dtype)
    x = torch.randn(batch, tokens, dim, generator=generator).to(dtype)
    grad = torch.randn(batch, tokens, hidden, generator=generator).to(dtype)

    results = []
    for function in (_plain_gate_up_swiglu, gate_up_swiglu):
        x_leaf, w_leaf = x.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        out = function(x_leaf, w_leaf)
        out.backward(grad)
        results.append((out.detach(), w_leaf.grad, x_leaf.grad))
    (out, grad_w, grad_x), (ours, ours_grad_w, ours_grad_x) = results
    assert ours.shape == (batch, tokens, hidden)
    assert torch.equal(out, ours)
    for ours_grad, grad in ((ours_grad_w, grad_w), (ours_grad_x, grad_x)):
        # One rounding of a sum against two of its terms' roundings: where the terms cancel, the
        # difference is a few ulps of the terms, not of the sum, so the bound is a share of the scale.
        share = 1e-6 if dtype == torch.float32 else 2e-2
        atol = share * float(grad.abs().amax()) if grad.numel() else 0.0
        torch.testing.assert_close(ours_grad, grad, rtol=share, atol=atol)
