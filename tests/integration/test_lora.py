"""LoRA on real Ray ranks and gloo: a frozen base, adapters on every layout, adapter checkpoints.

- One LoRA step on a multi-rank layout equals one rank's: the loss and every adapter gradient,
  within fp32 tolerance (after a first step, so that B is no longer zero and A has gradients).
- After LoRA steps on fsdp2 x tp2 from a base checkpoint, every rank's frozen weights are bit for
  bit the base's (their digests), and the run's checkpoints hold only adapter tensors and their
  moments, name their base, resume on another layout and refuse another base in one line.
- The per-rank-slice test: on fsdp4 each rank fills its shard of every adapter (and moment) with
  its own rank number, saves; loads on tp2 and on one rank (fresh ranks) hold every element where
  it was: their saves have the same digests, tensor by tensor.
"""
from __future__ import annotations

import pytest
import torch

from rayshard.plans.config import LoraConfig
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config

RTOL, ATOL = 1.3e-6, 1e-5  # assert_close's float32 defaults
LORA = LoraConfig(rank=4, alpha=8.0)


def _config(tmp_path, layout, **overrides):
    values = dict(global_batch=8, seq_len=16, run="l", lora=LORA, steps=3)
    values.update(overrides)
    return small_config(tmp_path, layout, **values)


def _second_step_gradients(rank_pool, config) -> tuple[float, dict[str, torch.Tensor]]:
    """One optimizer step, then the loss and full adapter gradients of the next batch."""
    from rayshard.cluster.run.rank_group import RankGroup

    group = RankGroup(config, rank_pool)
    try:
        group.call("train_step")
        results = group.call("full_gradients")
    finally:
        group.shutdown()
    gradients: dict[str, torch.Tensor] = {}
    for result in results:
        assert not gradients.keys() & result["gradients"].keys(), "a gradient reported by two ranks"
        gradients.update(result["gradients"])
    assert len({round(result["loss"], 6) for result in results}) == 1, "ranks disagree on the loss"
    return results[0]["loss"], gradients


@pytest.fixture(scope="module")
def single_rank(rank_pool, tmp_path_factory):
    return _second_step_gradients(rank_pool, _config(tmp_path_factory.mktemp("one"), ParallelLayout()))


@pytest.mark.parametrize("layout", [ParallelLayout(dp=2, tp=2),
                                    pytest.param(ParallelLayout(fsdp=2, tp=2), marks=pytest.mark.slow),
                                    pytest.param(ParallelLayout(tp=2, pp=2), marks=pytest.mark.slow)],
                         ids=str)
def test_one_lora_step_matches_one_rank(rank_pool, tmp_path, single_rank, layout):
    loss, gradients = _second_step_gradients(rank_pool, _config(tmp_path, layout))
    expected_loss, expected = single_rank
    # Only adapters have gradients, every one of them, A's included (B moved off zero in step 1).
    assert expected and all(".lora." in name for name in expected)
    assert len(expected) == 4 * 7 * 2
    assert all(gradient.abs().sum() > 0 for gradient in expected.values())
    assert sorted(gradients) == sorted(expected)
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(expected_loss), rtol=RTOL, atol=ATOL)
    for name, gradient in expected.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")
