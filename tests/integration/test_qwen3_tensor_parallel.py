"""Qwen3 under tensor parallelism: one q and one k norm weight serve every head, and a tp rank
holds only some heads, so each rank's gradient of those weights is a partial sum. The ranks add
them after the backward (`ModelPlan.tp_partial_gradients`); without that, the norm weights'
gradients on tp2 are each rank's share and the copies drift apart.

After one step the loss and every gradient equal one rank's (fp32 tolerances), on tp2, dp2 x tp2
and tp2 x pp2; over 10 steps the losses agree within 1e-5."""
from __future__ import annotations

import math

import pytest
import torch

from rayshard.plans.config import ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.integration.test_pipeline_numerics import ATOL, RTOL, one_step

QWEN3 = ModelChoice.named("tiny", family="qwen3", qk_norm=True)


def _config(tmp_path, layout, steps=1):
    return small_config(tmp_path, layout, model=QWEN3, global_batch=8, seq_len=16, steps=steps, run="q")


@pytest.fixture(scope="module")
def single(rank_pool, tmp_path_factory):
    return one_step(rank_pool, _config(tmp_path_factory.mktemp("one"), ParallelLayout()))


@pytest.mark.parametrize("layout", [ParallelLayout(tp=2), ParallelLayout(dp=2, tp=2), ParallelLayout(tp=2, pp=2)],
                         ids=["tp2", "dp2xtp2", "tp2xpp2"])
def test_one_step_equals_one_rank(rank_pool, single, tmp_path, layout):
    loss, gradients = one_step(rank_pool, _config(tmp_path, layout))
    reference_loss, reference = single
    assert math.isclose(loss, reference_loss, rel_tol=1e-6)
    assert gradients.keys() == reference.keys()
    norms = [name for name in reference if name.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * QWEN3.spec.n_layers
    for name in norms:  # the weights this is about: their gradient is not zero, so the check has teeth
        assert reference[name].abs().max() > 1e-4, name
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, reference[name], rtol=RTOL, atol=ATOL, msg=name)


@pytest.mark.slow  # decision 153: Qwen3 on dp2 x tp2 trains in test_hf_family_training[qwen3]
def test_ten_steps_on_dp2_x_tp2_follow_one_rank(run_training, tmp_path):
    one = run_training(_config(tmp_path / "one", ParallelLayout(), steps=10)).losses
    split = run_training(_config(tmp_path / "split", ParallelLayout(dp=2, tp=2), steps=10)).losses
    assert sorted(split) == list(range(1, 11))
    for step, loss in split.items():
        assert math.isclose(loss, one[step], rel_tol=1e-5), (step, loss, one[step])
