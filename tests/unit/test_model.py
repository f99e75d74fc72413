"""The reference model's fused layouts: contiguous row blocks are whole head groups / units."""
import pytest
import torch
import torch.nn.functional as F

from actors.model.transformer import Attention, FeedForward, Transformer
from actors.model.rope import rope_tables
from plans.training.model_spec import parameter_count, parameter_shapes, preset


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


def test_causal_model_output_does_not_depend_on_future_tokens():
    torch.manual_seed(2)
    model = Transformer(preset("tiny"))
    tokens = torch.randint(0, 256, (1, 12))
    changed = tokens.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % 256
    torch.testing.assert_close(model(tokens)[:, :8], model(changed)[:, :8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 12), (3, 7, 2), (1, 1, 320)])
def test_interleaved_swiglu_is_bit_identical_to_plain_autograd(shape, dtype):
    """The hand-written backward writes both halves of the fused gradient itself; values must be
    autograd's own, bit for bit (a swapped gate/up, or a gradient into the wrong half, fails).
    float32 runs the kernels on the stride-2 views, bf16 on contiguous copies of the halves
    (actors/model/swiglu.py): the reference is plain autograd on the same views or copies."""
    from actors.model.swiglu import interleaved_swiglu

    generator = torch.Generator().manual_seed(3)
    # Gates and ups of different scales per unit: swapping the halves changes every value.
    scale = torch.linspace(0.2, 4.0, shape[-1]) * torch.tensor([1.0, -0.3]).repeat(shape[-1] // 2)
    values = (torch.randn(shape, generator=generator) * scale).to(dtype)
    grad = torch.randn((*shape[:-1], shape[-1] // 2), generator=generator).to(dtype)

    def halves(v):
        pairs = v.unflatten(-1, (-1, 2))
        gate, up = pairs[..., 0], pairs[..., 1]
        return (gate, up) if dtype == torch.float32 else (gate.contiguous(), up.contiguous())

    results = []
    for function in (lambda v: F.silu(halves(v)[0]) * halves(v)[1], interleaved_swiglu):
        leaf = values.clone().requires_grad_(True)
        out = function(leaf)
        out.backward(grad)
        results.append((out.detach(), leaf.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
