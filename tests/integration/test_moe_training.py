"""Mixture of experts across layouts: moe-tiny (8 experts, top-2, a shared expert, layers 1 and 3
MoE) trained with expert parallelism (the experts split over the fsdp ranks, tokens sent by
all-to-all), combined with tp, dp and pp, computes what one rank computes.

After one step the loss and every gradient equal one rank's (fp32 tolerances); over 20 steps
the losses agree within 1e-5, and so do the tokens each expert got each step (dropless routing:
no layout drops or moves a token)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from rayshard.plans.config import ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import preset
from tests.conftest import small_config
from tests.integration.test_pipeline_numerics import ATOL, RTOL, one_step

MOE = preset("moe-tiny")

LAYOUTS = {
    "fsdp2(ep2)": ParallelLayout(fsdp=2, ep=2),
    "fsdp2(ep2)xtp2": ParallelLayout(fsdp=2, ep=2, tp=2),
    "fsdp2(ep2)xpp2": ParallelLayout(fsdp=2, ep=2, pp=2),
    "fsdp4(ep4)": ParallelLayout(fsdp=4, ep=4),
}
# Experts copied over dp replicas: their gradients averaged by the trainer, not FSDP.
WITH_REPLICAS = {"dp2xfsdp2(ep2)": ParallelLayout(dp=2, fsdp=2, ep=2)}
# The other router: sigmoid scores, the k weights renormalised, no shared expert, every layer MoE.
SIGMOID = preset("moe-tiny", router_scores="sigmoid", norm_topk=True, shared_expert_ffn_dim=0, moe_every=1)


def _config(tmp_path, layout, steps=1, model=MOE, **overrides):
    values = dict(model=ModelChoice("moe-tiny", model), global_batch=8, seq_len=16, steps=steps, run="moe")
    return small_config(tmp_path, layout, **{**values, **overrides})


@pytest.fixture(scope="module")
def single(rank_pool, tmp_path_factory):
    return one_step(rank_pool, _config(tmp_path_factory.mktemp("one"), ParallelLayout()))


@pytest.mark.parametrize("name", list(LAYOUTS) + list(WITH_REPLICAS))
def test_one_step_equals_one_rank(rank_pool, single, tmp_path, name):
    loss, gradients = one_step(rank_pool, _config(tmp_path, {**LAYOUTS, **WITH_REPLICAS}[name]))
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


@pytest.mark.parametrize("name", [pytest.param("fsdp2(ep2)xtp2", marks=pytest.mark.slow), "fsdp4(ep4)",  # the others under -m slow (decision 153)
                                  pytest.param("fsdp2(ep2)", marks=pytest.mark.slow),
                                  pytest.param("fsdp2(ep2)xpp2", marks=pytest.mark.slow)])
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
    # What the all-to-alls carried each step: every slot of every token out and back once per MoE
    # layer (each tp rank exchanges its own copy), as bench/moe.py reports it.
    records = [json.loads(line) for line in (tmp_path / "store" / "moe" / "metrics.jsonl").read_text().splitlines()]
    analytic = tokens_per_step * MOE.dim * 4 * 2 * len(MOE.moe_layers) * LAYOUTS[name].tp
    assert [record["all_to_all_bytes"] for record in records] == [analytic] * 20
    assert all(0 < record["all_to_all_peer_bytes"] < analytic for record in records)
    assert all(record["expert_load_imbalance"] >= 1.0 and record["aux_loss"] > 0 for record in records)


SCHEDULES = {"zbv": (2, 2), "zbh1": (1, 2), "dualpipev": (2, 4), "interleaved1f1b": (2, 2), "gpipe": (1, 2)}


@pytest.mark.parametrize("schedule", [pytest.param(name, marks=() if name == "zbv" else pytest.mark.slow) for name in SCHEDULES])
def test_every_schedule_with_ep_equals_one_rank(rank_pool, single, tmp_path, schedule):
    """The all-to-alls run inside the stages' forwards and input-gradient halves; zero-bubble
    schedules split the backward and must not replay them."""
    vpp, microbatches = SCHEDULES[schedule]
    layout = ParallelLayout(fsdp=2, ep=2, pp=2, vpp=vpp)
    loss, gradients = one_step(rank_pool, _config(tmp_path, layout, schedule=schedule, microbatches=microbatches))
    reference_loss, reference = single
    assert math.isclose(loss, reference_loss, rel_tol=1e-6)
    for key, gradient in gradients.items():
        torch.testing.assert_close(gradient, reference[key], rtol=RTOL, atol=ATOL, msg=key)


def test_recomputed_forwards_route_and_count_once(run_training, tmp_path):
    """Activation checkpointing recomputes each block inside the backward, and a zero-bubble
    schedule with it recomputes whole stages: the routing is counted once and the losses stay."""
    plain = run_training(_config(tmp_path / "plain", LAYOUTS["fsdp2(ep2)"], steps=3))
    recomputed = run_training(_config(tmp_path / "ac", ParallelLayout(fsdp=2, ep=2, pp=2, vpp=2), steps=3, ac="full",
                                      schedule="zbv", microbatches=2))
    assert recomputed.expert_tokens == plain.expert_tokens
    for step, loss in plain.losses.items():
        assert math.isclose(recomputed.losses[step], loss, rel_tol=1e-5), step


def test_bf16_with_ep_follows_fp32(run_training, twenty_steps_on_one_rank, tmp_path):
    """bf16 compute (experts cast where FSDP does not hold them) stays within bf16's reach of
    the float32 run; the float32 master weights are what checkpoints hold."""
    from rayshard.plans.config import OptimizerConfig

    same_schedule = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, decay_steps=20)  # the 20-step run's
    bf16 = run_training(_config(tmp_path, LAYOUTS["fsdp2(ep2)"], steps=4, precision="bf16", optimizer=same_schedule))
    for step, loss in bf16.losses.items():
        assert math.isclose(loss, twenty_steps_on_one_rank.losses[step], rel_tol=2e-2), step


def test_sigmoid_router_without_shared_expert_equals_one_rank(rank_pool, tmp_path):
    reference_loss, reference = one_step(rank_pool, _config(tmp_path / "one", ParallelLayout(), model=SIGMOID))
    loss, gradients = one_step(rank_pool, _config(tmp_path / "split", LAYOUTS["fsdp2(ep2)xtp2"], model=SIGMOID))
    assert math.isclose(loss, reference_loss, rel_tol=1e-6)
    assert not any(".shared" in key for key in reference) and len(SIGMOID.moe_layers) == SIGMOID.n_layers
    assert gradients.keys() == reference.keys()
    for key, gradient in gradients.items():
        torch.testing.assert_close(gradient, reference[key], rtol=RTOL, atol=ATOL, msg=key)
