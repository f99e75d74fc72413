"""Sequence parallelism (`--sp`) is tensor parallelism with the residual stream split over the
sequence: the same numbers as tp without sp (fp32 tolerances), with less activation memory."""
from __future__ import annotations

import math

import pytest
import torch

from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.integration.test_pipeline_numerics import RTOL, ATOL, one_step


def _config(tmp_path, layout, **overrides):
    values = dict(global_batch=8, seq_len=32, microbatches=2, run="sp")
    values.update(overrides)
    return small_config(tmp_path, layout, **values)


@pytest.mark.parametrize("degrees, schedule", [
    pytest.param({"tp": 2}, "1f1b", id="tp2"),
    pytest.param({"fsdp": 2, "tp": 2}, "1f1b", id="fsdp2xtp2", marks=pytest.mark.slow),  # decision 153
    pytest.param({"tp": 2, "pp": 2}, "zbh1", id="tp2xpp2-zbh1"),
])
def test_one_step_equals_tp_without_sp(rank_pool, tmp_path, degrees, schedule):
    layout = ParallelLayout(**degrees)
    plain_loss, plain = one_step(rank_pool, _config(tmp_path / "plain", layout, schedule=schedule))
    loss, gradients = one_step(rank_pool, _config(tmp_path / "sp", layout, schedule=schedule, sequence_parallel=True))
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(plain_loss), rtol=RTOL, atol=ATOL)
    assert gradients.keys() == plain.keys()
    for name, gradient in plain.items():
        torch.testing.assert_close(gradients[name], gradient, rtol=RTOL, atol=ATOL, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow  # decision 113: the default suite's 15 minutes
def test_ten_steps_follow_tp_without_sp(run_training, tmp_path):
    layout = ParallelLayout(dp=2, tp=2)
    plain = run_training(_config(tmp_path / "plain", layout)).losses
    sequence = run_training(_config(tmp_path / "sp", layout, sequence_parallel=True)).losses
    for step, loss in plain.items():
        assert math.isclose(sequence[step], loss, rel_tol=1e-5), (step, sequence[step], loss)


def test_sp_without_fsdp_clips_by_the_true_gradient_norm(run_training, tmp_path):
    """tp-only fp32 has no FSDP to reduce the norm weights' Partial gradients: the gradient norm
    must still be |sum of the parts|, the same as without sp."""
    import json

    layout = ParallelLayout(tp=2)
    norms = {}
    for name, sp in (("plain", False), ("sp", True)):
        run_training(_config(tmp_path / name, layout, steps=3, run=name, sequence_parallel=sp))
        lines = (tmp_path / name / "store" / name / "metrics.jsonl").read_text().splitlines()
        norms[name] = [json.loads(line)["grad_norm"] for line in lines if line.strip()]
    assert len(norms["plain"]) == len(norms["sp"]) == 3, norms
    for plain, sequence in zip(norms["plain"], norms["sp"]):
        assert math.isclose(sequence, plain, rel_tol=1e-6), norms


def test_sp_needs_tp_and_a_sequence_it_can_split(tmp_path):
    with pytest.raises(ConfigError, match="sequence_parallel=True: splits the sequence over the tp ranks, and tp is 1"):
        _config(tmp_path, ParallelLayout(), sequence_parallel=True)
    with pytest.raises(ConfigError, match=r"seq_len=33: must be a multiple of tp \(2\)"):
        _config(tmp_path, ParallelLayout(tp=2), sequence_parallel=True, seq_len=33)


def _saved_activation_bytes(rank: int, init_method: str, world_size: int, results, sequence_parallel: bool) -> None:
    """One tp rank's forward: the bytes autograd keeps for the backward (distinct storages)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rayshard.actors.parallel.init_weights import initialize_parameters
    from rayshard.actors.parallel.parallelize import parallelize
    from rayshard.actors.model.transformer import build_on_meta
    from rayshard.plans.layout.parallel_layout import MESH_DIM_NAMES
    from rayshard.plans.training.model_spec import preset
    from tests.saved_activations import kept_for_backward

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        config = preset("tiny", dim=128, ffn_dim=256)
        model = build_on_meta(config)
        parallelize(model, init_device_mesh("cpu", (1, 1, 1, 2), mesh_dim_names=MESH_DIM_NAMES), 2, 1,
                    sequence_parallel=sequence_parallel)
        model.to_empty(device="cpu")
        initialize_parameters(model, 1, config.n_layers)
        tokens = torch.randint(0, config.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
        with kept_for_backward(model.parameters()) as kept:
            model(tokens)
        results[rank] = kept.total
    finally:
        dist.destroy_process_group()


def test_sp_keeps_less_activation_memory_per_rank():
    from tests.forked_ranks import run_ranks

    kept = {sequence_parallel: max(run_ranks(_saved_activation_bytes, 2, sequence_parallel).values())
            for sequence_parallel in (False, True)}
    # The norms' inputs and the residual stream are kept for 1/tp of the tokens.
    assert kept[True] < 0.85 * kept[False], kept
    print(f"activation bytes kept per tp rank: without sp {kept[False] >> 10} KiB, with sp {kept[True] >> 10} KiB")
