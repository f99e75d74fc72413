"""bf16 over a one-rank data mesh makes FSDP2's casts without FSDP2 (actors/parallel/parameter_casts.py,
decision 80). Decision 57's promise is that bf16 means the same numbers on every layout, so the
casts must give FSDP2's numbers exactly: each case trains 3 steps of 2 microbatches both ways,
FSDP2 forced over the one-rank mesh as before, and compares every loss, gradient norm and final
float32 parameter bit for bit. A cast taken once and kept across a step, a gradient accumulated
in bf16 instead of float32, an input left in float32 or a tied weight cast twice each changes bits.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

import rayshard.actors.parallel.parallelize as parallelize
from rayshard.actors.training.trainer import Trainer
from rayshard.plans.config import ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.forked_ranks import run_ranks
from tests.free_port import free_port

STEPS = 3


def _train(config, rank: int, init_method: str, force_fsdp: bool) -> tuple[list[tuple[float, float]], dict]:
    """Losses and gradient norms of each step, and the rank's float32 parameters at the end."""
    if force_fsdp:  # the reference: FSDP2 over the one-rank data mesh, decision 57 as first built
        original = parallelize.uses_fsdp
        parallelize.uses_fsdp = lambda precision, data_parallel_size, pipeline=False: True
    try:
        trainer = Trainer(config, rank, init_method, device="cpu")
        assert isinstance(trainer.model, FSDPModule) == force_fsdp  # the two mechanisms, not one twice
        steps = [(metrics.loss, metrics.grad_norm) for metrics in (trainer.train_step() for _ in range(STEPS))]
        params = {name: (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().clone()
                  for name, param in trainer.model.named_parameters()}
        assert {param.dtype for param in params.values()} == {torch.float32}  # the masters, never the casts
        trainer.shutdown()
        return steps, params
    finally:
        if force_fsdp:
            parallelize.uses_fsdp = original


def _assert_same(casts, fsdp) -> None:
    assert casts[0] == fsdp[0], (casts[0], fsdp[0])
    assert casts[1].keys() == fsdp[1].keys()
    for name, value in fsdp[1].items():
        assert torch.equal(casts[1][name], value), name


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="one-rank"),
    pytest.param({"ac": "full"}, id="full-ac"),
    pytest.param({"ac": "selective"}, id="selective-ac"),
    pytest.param({"model": ModelChoice.named("moe-tiny")}, id="moe"),
    # The embedding and the LM head share one parameter: both modules must read its one cast.
    pytest.param({"model": ModelChoice.named("tiny", tie_embeddings=True)}, id="tied-embeddings"),
    pytest.param({"compile": True}, id="compile", marks=pytest.mark.slow),
])
def test_one_rank_casts_match_fsdp2_bit_for_bit(tmp_path, overrides):
    config = small_config(tmp_path, precision="bf16", steps=STEPS, microbatches=2, **overrides)
    casts = _train(config, 0, f"tcp://127.0.0.1:{free_port()}", force_fsdp=False)
    fsdp = _train(config, 0, f"tcp://127.0.0.1:{free_port()}", force_fsdp=True)
    _assert_same(casts, fsdp)
    assert casts[0][-1][0] < casts[0][0][0]  # it trained


def _tp_rank(rank, init_method, world_size, results, config, force_fsdp):
    torch.set_num_threads(1)
    results[rank] = _train(config, rank, init_method, force_fsdp)


def test_tensor_parallel_casts_match_fsdp2_bit_for_bit(tmp_path):
    """tp2 (a one-rank data mesh over two ranks): the casts of DTensor parameters, the sequence
    shards' norms included."""
    config = small_config(tmp_path, ParallelLayout(tp=2), precision="bf16", steps=STEPS, microbatches=2,
                          sequence_parallel=True)
    casts = run_ranks(_tp_rank, 2, config, False)
    fsdp = run_ranks(_tp_rank, 2, config, True)
    for rank in (0, 1):
        _assert_same(casts[rank], fsdp[rank])
