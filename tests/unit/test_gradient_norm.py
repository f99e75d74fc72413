"""The gradient norm, which scales every gradient when it clips, must not depend on the layout:
only on the gradient values, however a layout cuts them into pieces and spreads them over ranks.

Checked through `gradient_norm` itself, on real gloo process groups (its all-reduce across ranks),
against an exact reference that shares no code with it: the correctly rounded square root of the
exact (math.fsum) sum of squares, rounded to float32. The clip itself happens inside fused AdamW
(`clip_divisor` becomes its grad_scale): checked against AdamW stepping on gradients clipped by hand."""
from __future__ import annotations

import math
import random

import torch
import torch.distributed as dist

from actors.model.gradient_norm import clip_divisor, gradient_norm
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


def _norm_on_this_rank(pieces: list[torch.Tensor], coords: dict) -> torch.Tensor:
    parameters = [torch.nn.Parameter(torch.zeros(p.shape)) for p in pieces]
    for parameter, piece in zip(parameters, pieces):
        parameter.grad = piece.clone()
    norm = gradient_norm(parameters, coords=coords)
    assert all(torch.equal(p.grad, piece) for p, piece in zip(parameters, pieces))  # measured, not changed
    return norm


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
            outcome[seed, layout] = _norm_on_this_rank(pieces, coords)
        results[rank] = outcome
    finally:
        dist.destroy_process_group()


def test_the_all_reduced_norm_is_the_exact_one_on_every_rank_however_a_layout_cuts_the_gradients():
    outcome = run_ranks(_rank, WORLD)
    for seed, layout in PARTITIONS:
        reference = _exact_norm(_gradients(seed))
        for rank in range(WORLD):
            norm = outcome[rank][seed, layout]
            assert norm.dtype == torch.float32
            assert torch.equal(norm, reference), (seed, layout, rank, float(norm), float(reference))


def test_one_rank_without_a_process_group_measures_the_exact_norm():
    gradients = _gradients(3)
    norm = _norm_on_this_rank(gradients, PRIMARY)
    assert norm.dtype == torch.float32 and torch.equal(norm, _exact_norm(gradients))


def test_a_replica_counts_nothing_on_its_own():
    gradients = _gradients(2)
    assert float(_norm_on_this_rank(gradients, {"dp": 0, "fsdp": 0, "tp": 1})) == 0.0


def test_the_divisor_clips_to_max_norm_and_is_exactly_one_under_it():
    gradients = _gradients(3)
    norm = _exact_norm(gradients)
    assert norm > 2.0
    divisor = clip_divisor(norm, 2.0)
    assert divisor.shape == () and torch.equal(divisor, (norm + 1e-6) / 2.0)
    assert abs(float(_exact_norm([g / divisor for g in gradients])) - 2.0) < 1e-5
    assert float(clip_divisor(norm, float(norm) * 4)) == 1.0  # under the limit: gradients untouched
    assert clip_divisor(norm, 0.0) is None  # max_norm 0: measure only, never clip


def _adamw_step(gradients: list[torch.Tensor], grad_scale: torch.Tensor | None) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    parameters = [torch.nn.Parameter(torch.randn(g.shape, generator=generator)) for g in gradients]
    optimizer = torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.1, fused=True)
    for _ in range(2):
        for parameter, gradient in zip(parameters, gradients):
            parameter.grad = gradient.clone()
        optimizer.grad_scale = grad_scale
        optimizer.step()
    return [p.detach() for p in parameters]


def test_fused_adamw_with_the_divisor_steps_as_on_gradients_clipped_by_hand():
    """The trainer clips by handing `clip_divisor` to fused AdamW as its grad_scale: the update
    must be the one on gradients divided first, bit for bit, and differ from the unclipped one."""
    gradients = _gradients(4)
    divisor = clip_divisor(_exact_norm(gradients), 1.0)
    assert float(divisor) > 1.5
    inside = _adamw_step(gradients, divisor)
    by_hand = _adamw_step([g / divisor for g in gradients], None)
    unclipped = _adamw_step(gradients, None)
    assert all(torch.equal(a, b) for a, b in zip(inside, by_hand))
    assert not all(torch.equal(a, b) for a, b in zip(inside, unclipped))
    assert all(torch.equal(a, b) for a, b in zip(_adamw_step(gradients, torch.tensor(1.0)), unclipped))
