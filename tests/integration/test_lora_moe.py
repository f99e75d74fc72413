"""LoRA on a mixture-of-experts model (moe-tiny: layers 1 and 3 MoE with a shared expert, 0 and 2
dense): adapters on attention, the dense feed-forwards and the shared experts; the router and
the routed experts frozen (docs/decisions.md 140).

- One LoRA step on fsdp2(ep2) equals one rank's: the loss and every adapter gradient.
- The issue's resume check (slow): dp2 x tp2 for 4 steps, resumed on fsdp2(ep2) for 20, every
  resumed loss within 2.5e-6 relative of the uninterrupted dp2 x tp2 run's.
"""
from __future__ import annotations

import pytest
import torch

from rayshard.plans.config import LoraConfig, ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.integration.test_lora_training import _second_step_gradients

LORA = LoraConfig(rank=4, alpha=8.0)  # every target: q, k, v, o, gate, up, down


def _config(tmp_path, layout, run="m", **overrides):
    values = dict(model=ModelChoice.named("moe-tiny"), global_batch=8, seq_len=16, run=run, lora=LORA, steps=3)
    values.update(overrides)
    return small_config(tmp_path, layout, **values)


def test_one_moe_lora_step_on_ep2_matches_one_rank(rank_pool, tmp_path):
    one_loss, one = _second_step_gradients(rank_pool, _config(tmp_path, ParallelLayout(), run="one"))
    loss, gradients = _second_step_gradients(rank_pool, _config(tmp_path, ParallelLayout(fsdp=2, ep=2), run="ep"))
    # Only adapters train: attention's, the dense layers' (0, 2) and the shared experts' (1, 3).
    assert set(gradients) == set(one)
    assert {name.split(".lora.")[0] for name in one} == {
        *(f"layers.{i}.attention" for i in range(4)), "layers.0.feed_forward", "layers.2.feed_forward",
        "layers.1.feed_forward.shared", "layers.3.feed_forward.shared"}
    assert loss == pytest.approx(one_loss, rel=1e-6)
    for name, gradient in one.items():
        assert gradient.abs().max() > 0, name  # after a step B is not zero: every adapter has a gradient
        torch.testing.assert_close(gradients[name], gradient, rtol=1.3e-6, atol=1e-5, msg=name)


@pytest.mark.slow
def test_a_moe_lora_run_resumed_on_ep2_continues_the_uninterrupted_run(run_training, tmp_path):
    from rayshard.plans.config import OptimizerConfig
    from tests.integration.reshard_helpers import resume_continuity

    def config(layout, steps, total, run, **overrides):
        optimizer = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, decay_steps=total)
        return _config(tmp_path, layout, steps=steps, run=run, optimizer=optimizer, seq_len=32, **overrides)

    _, full, resumed = resume_continuity(run_training, tmp_path, config, ParallelLayout(dp=2, tp=2),
                                         ParallelLayout(fsdp=2, ep=2), 4, 20, 2.5e-6)
    assert full.losses[24] < full.losses[1] - 0.2  # the adapters learn: equal losses are not a frozen model's
