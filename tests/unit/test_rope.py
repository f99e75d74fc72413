import torch

from actors.model.rope import apply_rope, apply_rope_reference, rope_tables


def _asymmetric_tables(seq, head_dim):
    # The two halves of cos and sin differ, so a backward that assumed rotate-half symmetry
    # (cos/sin equal in both halves) gives the wrong gradient and fails here.
    generator = torch.Generator().manual_seed(3)
    cos = torch.rand(seq, head_dim, generator=generator, dtype=torch.float64) * 2 - 1
    sin = torch.rand(seq, head_dim, generator=generator, dtype=torch.float64) * 2 - 1
    assert not torch.allclose(cos[:, : head_dim // 2], cos[:, head_dim // 2:])
    assert not torch.allclose(sin[:, : head_dim // 2], sin[:, head_dim // 2:])
    return cos, sin


def test_custom_backward_matches_autograd_on_reference_with_asymmetric_halves():
    cos, sin = _asymmetric_tables(7, 8)
    x = torch.randn(2, 7, 3, 8, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(2, 7, 3, 8, dtype=torch.float64)
    (grad_custom,) = torch.autograd.grad(apply_rope(x, cos, sin), x, upstream)
    (grad_reference,) = torch.autograd.grad(apply_rope_reference(x, cos, sin), x, upstream)
    torch.testing.assert_close(grad_custom, grad_reference, rtol=0, atol=1e-12)


def test_custom_rope_passes_gradcheck():
    cos, sin = _asymmetric_tables(5, 6)
    x = torch.randn(1, 5, 2, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))


def test_forward_matches_reference_and_rotation_preserves_norm():
    cos, sin = rope_tables(16, 8, 10000.0)
    x = torch.randn(2, 16, 4, 8)
    out = apply_rope(x, cos, sin)
    torch.testing.assert_close(out, apply_rope_reference(x, cos, sin))
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1))
    # Position 0 is the identity rotation.
    torch.testing.assert_close(out[:, 0], x[:, 0])
