"""The gradient norm, which scales every gradient when it clips, must not depend on the layout:
only on the gradient values, however a layout cuts them into pieces and spreads them over ranks.

Checked through `clip_grad_norm` itself, on real gloo process groups (its all-reduce across ranks),
against an exact reference that shares no code with it: the correctly rounded square root of the
exact (math.fsum) sum of squares, rounded to float32."""
from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist

from rayshard.actors.parallel.gradient_norm import clip_grad_norm
from tests.forked_ranks import run_ranks

WORLD = 4
PARTITIONS = [(seed, layout) for seed in range(4) for layout in range(4)]
PRIMARY = {"dp": 0, "fsdp": 0, "tp": 0}


def _gradients(seed: int) -> list[torch.Tensor]:
    """Gradients of a few shapes with a wide spread of magnitudes, as real ones have."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(48, 32), (32,), (96, 32), (32, 64), (7, 5)]
    return [torch.randn(shape, generator=generator) * 10 ** torch.empty(shape).uniform_(-4, 1, generator=generator)
            for shape in shapes]


def _exact_norm(gradients: list[torch.Tensor]) -> torch.Tensor:
    # A float32 value squared is exact in float64; fsum adds exactly; sqrt rounds once.
    squares = [float(v) ** 2 for g in gradients for v in g.flatten().tolist()]
    return torch.tensor(math.sqrt(math.fsum(squares)), dtype=torch.float64).float()


def _deal(gradients: list[torch.Tensor], seed: int, ranks: int) -> list[list[torch.Tensor]]:
    """The same values cut into row pieces at random places and dealt to the ranks, each rank's
    pieces in parameter order (as a dp/fsdp/tp layout would cut and place them); a rank may get none."""
    rng = random.Random(seed)
    dealt: list[list[torch.Tensor]] = [[] for _ in range(ranks)]
    for gradient in gradients:
        rows = gradient.shape[0]
        cuts = sorted(rng.sample(range(1, rows), min(rows - 1, rng.randint(0, 3))))
        for start, stop in zip([0, *cuts], [*cuts, rows]):
            dealt[rng.randrange(ranks)].append(gradient[start:stop].clone())
    return dealt


def _clip_on_this_rank(pieces: list[torch.Tensor], coords: dict, max_norm: float):
    parameters = [torch.nn.Parameter(torch.zeros(p.shape)) for p in pieces]
    for parameter, piece in zip(parameters, pieces):
        parameter.grad = piece.clone()
    norm = clip_grad_norm(parameters, max_norm=max_norm, coords=coords)
    return norm, [p.grad for p in parameters]


def _rank(rank: int, init_method: str, world_size: int, results) -> None:
    """Ranks 0-2 hold different pieces of the gradients (primary holders); rank 3 is a dp replica
    of all of them (dp=1), whose copies the norm must not count again."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        outcome = {}
        for seed, layout in PARTITIONS:
            gradients = _gradients(seed)
            if rank < WORLD - 1:
                pieces, coords = _deal(gradients, seed * 100 + layout, WORLD - 1)[rank], PRIMARY
            else:
                pieces, coords = [g.clone() for g in gradients], {"dp": 1, "fsdp": 0, "tp": 0}
            outcome[seed, layout] = (pieces, *_clip_on_this_rank(pieces, coords, max_norm=1.0))
        results[rank] = outcome
    finally:
        dist.destroy_process_group()


def test_the_all_reduced_norm_is_the_exact_one_on_every_rank_however_a_layout_cuts_the_gradients():
    outcome = run_ranks(_rank, WORLD)
    for seed, layout in PARTITIONS:
        reference = _exact_norm(_gradients(seed))
        assert reference > 1.0  # so the clip scales, and a wrong norm shows in the gradients too
        scale = torch.clamp(1.0 / (reference + 1e-6), max=1.0)
        for rank in range(WORLD):
            pieces, norm, clipped = outcome[rank][seed, layout]
            assert norm.dtype == torch.float32
            assert torch.equal(norm, reference), (seed, layout, rank, float(norm), float(reference))
            assert all(torch.equal(c, p * scale) for c, p in zip(clipped, pieces)), (seed, layout, rank)


def test_one_rank_without_a_process_group_clips_to_the_exact_norm():
    gradients = _gradients(3)
    norm, clipped = _clip_on_this_rank(gradients, PRIMARY, max_norm=1.0)
    reference = _exact_norm(gradients)
    assert norm.dtype == torch.float32 and torch.equal(norm, reference)
    scale = torch.clamp(1.0 / (reference + 1e-6), max=1.0)
    assert all(torch.equal(c, g * scale) for c, g in zip(clipped, gradients))
    assert abs(float(_exact_norm(clipped)) - 1.0) < 1e-5


def test_a_norm_under_the_limit_leaves_the_gradients_alone_and_max_norm_0_only_measures():
    small = [g * 1e-4 for g in _gradients(5)]
    assert _exact_norm(small) < 1.0
    norm, clipped = _clip_on_this_rank(small, PRIMARY, max_norm=1.0)
    assert torch.equal(norm, _exact_norm(small)) and all(torch.equal(c, g) for c, g in zip(clipped, small))
    large = _gradients(5)
    norm, clipped = _clip_on_this_rank(large, PRIMARY, max_norm=0.0)
    assert torch.equal(norm, _exact_norm(large)) and all(torch.equal(c, g) for c, g in zip(clipped, large))


def test_a_replica_counts_nothing_on_its_own():
    gradients = _gradients(2)
    norm, clipped = _clip_on_this_rank(gradients, {"dp": 0, "fsdp": 0, "tp": 1}, max_norm=1.0)
    assert float(norm) == 0.0


def test_a_rank_without_gradients_sums_on_its_parameters_device():
    """NCCL all-reduces device tensors only: a rank holding no gradient still makes its (zero)
    sum on the parameters' device, not on the CPU (meta stands in for the GPU here)."""
    parameters = [torch.nn.Parameter(torch.empty(4, 3, device="meta"))]
    assert clip_grad_norm(parameters, max_norm=1.0, coords=PRIMARY).device.type == "meta"


def test_pieces_longer_than_a_chunk_and_chunk_tails_sum_exactly(monkeypatch):
    """The CPU sum converts a chunk at a time (`_NORM_CHUNK`): pieces several chunks long, with a
    tail shorter than a chunk, and pieces shorter than one, must all be counted exactly once."""
    import rayshard.actors.parallel.gradient_norm as gradient_norm

    monkeypatch.setattr(gradient_norm, "_NORM_CHUNK", 97)  # odd, smaller than most pieces, not dividing them
    gradients = _gradients(6)
    assert max(g.numel() for g in gradients) > 10 * 97 and min(g.numel() for g in gradients) < 97
    norm, _ = _clip_on_this_rank(gradients, PRIMARY, max_norm=0.0)
    assert torch.equal(norm, _exact_norm(gradients))
