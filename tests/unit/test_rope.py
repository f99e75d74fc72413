"""RoPE against references that do not share our code: Hugging Face Llama's rotation and tables
(the convention our weights export to), and a rotation written out by hand."""
import math

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from rayshard.actors.model.rope import apply_rope, rope_tables


def _asymmetric_tables(seq, head_dim):
    # The two halves of cos and sin differ, so a backward that assumed rotate-half symmetry
    # (cos/sin equal in both halves) gives the wrong gradient and fails here.
    generator = torch.Generator().manual_seed(3)
    cos = torch.rand(seq, head_dim, generator=generator, dtype=torch.float64) * 2 - 1
    sin = torch.rand(seq, head_dim, generator=generator, dtype=torch.float64) * 2 - 1
    assert not torch.allclose(cos[:, : head_dim // 2], cos[:, head_dim // 2:])
    assert not torch.allclose(sin[:, : head_dim // 2], sin[:, head_dim // 2:])
    return cos, sin


def _hf_rope(x, cos, sin):
    """transformers' Llama rotation of x [batch, seq, heads, head_dim] with tables [seq, head_dim]."""
    rotated, _ = apply_rotary_pos_emb(x, x, cos[None], sin[None], unsqueeze_dim=2)
    return rotated


def test_forward_and_backward_match_hugging_face_with_asymmetric_halves():
    cos, sin = _asymmetric_tables(7, 8)
    x = torch.randn(2, 7, 3, 8, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 7, 3, 8, dtype=torch.float64)
    ours, theirs = apply_rope(x, cos, sin), _hf_rope(x, cos, sin)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    (grad_ours,) = torch.autograd.grad(ours, x, upstream)
    (grad_theirs,) = torch.autograd.grad(theirs, x, upstream)
    torch.testing.assert_close(grad_ours, grad_theirs, rtol=0, atol=1e-12)


def test_custom_rope_passes_gradcheck():
    cos, sin = _asymmetric_tables(5, 6)
    x = torch.randn(1, 5, 2, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))


def test_tables_equal_hugging_face_llamas():
    head_dim, seq, theta = 8, 33, 500.0
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, rope_theta=theta)
    assert config.head_dim == head_dim
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, seq, head_dim), torch.arange(seq)[None])
    cos, sin = rope_tables(seq, head_dim, theta)
    # transformers computes in float32; ours in float64 then rounds: a few float32 ulp apart.
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-6)


def test_tables_are_float64_angles_rounded_once():
    """At position 4095 an angle computed in float32 is off by ~1e-4: the tables must come from
    float64 angles (so every rank's tables are the same), here computed with Python floats."""
    seq, head_dim, theta = 4096, 16, 10000.0
    cos, sin = rope_tables(seq, head_dim, theta)
    assert cos.shape == sin.shape == (seq, head_dim) and cos.dtype == sin.dtype == torch.float32
    positions = [0, 1, 2, 1000, 4095]
    angles = [[p * theta ** (-(2 * (i % (head_dim // 2))) / head_dim) for i in range(head_dim)] for p in positions]
    expected_cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64).float()
    expected_sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64).float()
    torch.testing.assert_close(cos[positions], expected_cos, rtol=0, atol=1e-7)
    torch.testing.assert_close(sin[positions], expected_sin, rtol=0, atol=1e-7)


def test_tables_are_made_on_the_device_asked_for():
    cos, sin = rope_tables(4, 8, 10000.0, device="meta")
    assert cos.device.type == sin.device.type == "meta"


def test_rotation_direction_by_hand():
    """head_dim 2: the pair (a, b) at angle t becomes (a cos t - b sin t, b cos t + a sin t),
    counter-clockwise, the direction Llama uses."""
    theta, positions = 10000.0, 5
    cos, sin = rope_tables(positions, 2, theta)
    x = torch.tensor([1.0, 2.0]).expand(1, positions, 1, 2)
    out = apply_rope(x, cos, sin)[0, :, 0]
    expected = torch.tensor([[math.cos(p) - 2 * math.sin(p), 2 * math.cos(p) + math.sin(p)] for p in range(positions)])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.norm(dim=-1), x[0, :, 0].norm(dim=-1))
