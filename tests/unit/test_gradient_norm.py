"""The gradient norm, which scales every gradient when it clips, must not depend on the layout:
only on the gradient values, however a layout cuts them into pieces and spreads them over ranks."""
import random

import torch

from actors.model.parallelize import clip_grad_norm, squares_sum


def _gradients(seed: int) -> list[torch.Tensor]:
    """Gradients of a few shapes with a wide spread of magnitudes, as real ones have."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(48, 32), (32,), (96, 32), (32, 64), (7, 5)]
    return [torch.randn(shape, generator=generator) * 10 ** torch.empty(shape).uniform_(-4, 1, generator=generator)
            for shape in shapes]


def _as_layout_would_hold_them(gradients: list[torch.Tensor], seed: int) -> list[list[torch.Tensor]]:
    """The same values cut into row pieces at random places and dealt to 1-4 ranks, each rank's
    pieces in parameter order (as a dp/fsdp/tp layout would cut and place them)."""
    rng = random.Random(seed)
    ranks: list[list[torch.Tensor]] = [[] for _ in range(rng.randint(1, 4))]
    for gradient in gradients:
        rows = gradient.shape[0]
        cuts = sorted(rng.sample(range(1, rows), min(rows - 1, rng.randint(0, 3))))
        for start, stop in zip([0, *cuts], [*cuts, rows]):
            rng.choice(ranks).append(gradient[start:stop])
    return ranks


def _norm_across_ranks(ranks: list[list[torch.Tensor]]) -> torch.Tensor:
    """What clip_grad_norm computes: each rank's float64 sum, all-reduced (in some rank order)."""
    total = torch.zeros((), dtype=torch.float64)
    for pieces in ranks:
        if pieces:
            total = total + squares_sum(pieces)
    return total.sqrt().float()


def test_the_norm_is_the_same_however_a_layout_cuts_and_places_the_gradients():
    # In float32 these partitions give norms up to a few ulp apart (checked by hand: summing
    # `_foreach_norm(pieces)` in float32 fails this test for most seeds).
    for seed in range(20):
        gradients = _gradients(seed)
        reference = _norm_across_ranks([gradients])
        for layout in range(12):
            ranks = _as_layout_would_hold_them(gradients, seed * 100 + layout)
            assert torch.equal(_norm_across_ranks(ranks), reference), (seed, layout)
            assert torch.equal(_norm_across_ranks(ranks[::-1]), reference), (seed, layout)


def test_clip_scales_every_gradient_by_the_same_float32_factor():
    parameters = [torch.nn.Parameter(torch.zeros(g.shape)) for g in _gradients(3)]
    for parameter, gradient in zip(parameters, _gradients(3)):
        parameter.grad = gradient.clone()
    norm = clip_grad_norm(parameters, max_norm=1.0, coords={"dp": 0, "fsdp": 0, "tp": 0})
    assert norm.dtype == torch.float32
    assert torch.equal(norm, _norm_across_ranks([_gradients(3)]))
    scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
    for parameter, gradient in zip(parameters, _gradients(3)):
        assert torch.equal(parameter.grad, gradient * scale)
    assert abs(float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in parameters]))) - 1.0) < 1e-5
