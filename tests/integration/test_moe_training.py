"""Mixture of experts across layouts: moe-tiny (8 experts, top-2, a shared expert, layers 1 and 3
MoE) trained with expert parallelism (the experts split over the fsdp ranks, tokens sent by
all-to-all), combined with tp, dp and pp, computes what one rank computes.

After one step the loss and every gradient equal one rank's (fp32 tolerances); over 20 steps
the losses agree within 1e-5, and so do the tokens each expert got each step (dropless routing:
no layout drops or moves a token)."""
from __future__ import annotations

import math

import pytest
import torch

from plans.layout.parallel_layout import ParallelLayout
from plans.training.model_spec import preset
from tests.conftest import small_config
from tests.integration.test_pipeline_numerics import ATOL, RTOL, one_step

MOE = preset("moe-tiny")

LAYOUTS = {
    "fsdp2(ep2)": ParallelLayout(fsdp=2, ep=2),
    "fsdp2(ep2)xtp2": ParallelLayout(fsdp=2, ep=2, tp=2),
    "fsdp2(ep2)xpp2": ParallelLayout(fsdp=2, ep=2, pp=2),
    "fsdp4(ep4)": ParallelLayout(fsdp=4, ep=4),
}


def _config(tmp_path, layout, steps=1, **overrides):
    return small_config(tmp_path, layout, model=MOE, global_batch=8, seq_len=16, steps=steps, run="moe",
                        model_preset="moe-tiny", **overrides)


@pytest.fixture(scope="module")
def single(rank_pool, tmp_path_factory):
    return one_step(rank_pool, _config(tmp_path_factory.mktemp("one"), ParallelLayout()))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_step_equals_one_rank(rank_pool, single, tmp_path, name):
    loss, gradients = one_step(rank_pool, _config(tmp_path, LAYOUTS[name]))
    reference_loss, reference = single
    assert math.isclose(loss, reference_loss, rel_tol=1e-6), (loss, reference_loss)
    assert gradients.keys() == reference.keys()
    experts = [name for name in reference if ".experts." in name or ".router." in name]
    assert len(experts) == 3 * len(MOE.moe_layers)
    for expert in experts:  # the weights this is about: their gradient is not zero, so the check has teeth
        assert reference[expert].abs().max() > 1e-6, expert
    for key, gradient in gradients.items():
        torch.testing.assert_close(gradient, reference[key], rtol=RTOL, atol=ATOL, msg=key)


@pytest.fixture(scope="module")
def twenty_steps_on_one_rank(run_training, tmp_path_factory):
    return run_training(_config(tmp_path_factory.mktemp("one20"), ParallelLayout(), steps=20))


@pytest.mark.parametrize("name", ["fsdp2(ep2)", "fsdp2(ep2)xtp2", "fsdp2(ep2)xpp2", "fsdp4(ep4)"])
def test_twenty_steps_follow_one_rank(run_training, twenty_steps_on_one_rank, tmp_path, name):
    one = twenty_steps_on_one_rank
    split = run_training(_config(tmp_path, LAYOUTS[name], steps=20))
    assert sorted(split.losses) == list(range(1, 21))
    for step, loss in split.losses.items():
        assert math.isclose(loss, one.losses[step], rel_tol=1e-5), (step, loss, one.losses[step])
    # Tokens per expert per step, logged by every layout, equal: no token dropped or sent twice.
    assert split.expert_tokens == one.expert_tokens
    tokens_per_step = 8 * 16 * MOE.experts_per_token  # global batch x seq x k
    for step, layers in one.expert_tokens.items():
        assert sorted(layers) == list(MOE.moe_layers)
        assert all(sum(counts) == tokens_per_step for counts in layers.values()), step
    loads = {tuple(counts) for layers in one.expert_tokens.values() for counts in layers.values()}
    assert len(loads) > 1  # routing changes between steps and layers: the comparison is not of constants
