"""LoRA on a user's own model (`examples/gpt2` through `--model-factory`): targets by module-name
pattern or by the names its plan declares (docs/decisions.md 141). One LoRA step on pp2, and on
tp2, equals one rank's: the loss and every adapter gradient, and nothing else takes a gradient."""
from __future__ import annotations

import pytest
import torch

from rayshard.actors.model.user_model import describe_factory
from rayshard.plans.config import LoraConfig, ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.integration.test_lora_training import _second_step_gradients

FACTORY = "examples.gpt2.model:tiny_gpt2"
LORA = LoraConfig(rank=4, alpha=8.0, targets="q,v,blocks.*.mlp.*,lm_head")


def _config(tmp_path, layout, run, lora=LORA, **overrides):
    values = dict(model=ModelChoice(FACTORY, describe_factory(FACTORY)), global_batch=8, seq_len=16, run=run, lora=lora,
                  steps=3)
    values.update(overrides)
    return small_config(tmp_path, layout, **values)


def test_one_user_model_lora_step_on_pp2_matches_one_rank(rank_pool, tmp_path):
    one_loss, one = _second_step_gradients(rank_pool, _config(tmp_path, ParallelLayout(), "one"))
    loss, gradients = _second_step_gradients(rank_pool, _config(tmp_path, ParallelLayout(pp=2), "pp", microbatches=2))
    assert set(one) == set(gradients) == {
        f"{module}.{ab}" for ab in "ab" for module in
        ("lora.lm_head", *(f"blocks.{i}.{part}" for i in range(4)
                           for part in ("attn.lora.q", "attn.lora.v", "mlp.lora.fc", "mlp.lora.proj")))}
    assert loss == pytest.approx(one_loss, rel=1e-6)
    for name, gradient in one.items():
        assert gradient.abs().max() > 0, name
        torch.testing.assert_close(gradients[name], gradient, rtol=1.3e-6, atol=1e-5, msg=name)


@pytest.mark.parametrize("factory, sp", [(FACTORY, False), ("examples.gpt2.model:tiny_gpt2_without_positions", True)],
                         ids=["tp2", "tp2-sp"])
def test_one_user_model_lora_step_on_tp2_matches_one_rank(rank_pool, tmp_path, factory, sp):
    """Every name the plan declares (q, k, v, o, up, down): adapters beside column-parallel q, k, v
    and fc (B split) and row-parallel projections (A split), hooked after torch's tp styles; with
    --sp the row-parallel ones' deltas cut to the rank's sequence shard."""
    every = LoraConfig(rank=4, alpha=8.0)
    model = ModelChoice(factory, describe_factory(factory))
    one_loss, one = _second_step_gradients(rank_pool, _config(tmp_path, ParallelLayout(), "one", every, model=model))
    loss, gradients = _second_step_gradients(rank_pool, _config(tmp_path, ParallelLayout(tp=2), "tp", every, model=model,
                                                                sequence_parallel=sp))
    assert set(one) == set(gradients) and len(one) == 4 * 6 * 2
    assert loss == pytest.approx(one_loss, rel=1e-6)
    for name, gradient in one.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=1.3e-6, atol=1e-5, msg=name)
