"""bf16 mixed precision, activation checkpointing and compile on real Ray ranks and gloo groups.

bf16 rounds differently from fp32, so layouts agree within bf16's tolerance (2e-2 relative loss
over 20 steps, and 5e-2 of the fp32 run), not fp32's. Activation checkpointing recomputes the same
ops on the same inputs, so it changes no bit of the loss; compile fuses kernels, so it agrees with
eager within 1e-5. Checkpoints of a bf16 run hold the float32 master state: they resume bit-exact
in bf16 and load intact into an fp32 run on another layout.
"""
from __future__ import annotations

import math

import pytest
import torch

from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.catalog.store import Store
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config

BF16_RTOL = 2e-2  # a bf16 layout against the one-rank bf16 run
FP32_RTOL = 5e-2  # a bf16 run against the fp32 run


def _config(tmp_path, layout=None, **overrides):
    values = dict(steps=20, global_batch=8, seq_len=32, microbatches=2, run="p")
    values.update(overrides)
    return small_config(tmp_path, layout or ParallelLayout(), **values)


@pytest.fixture(scope="module")
def one_rank(run_training, tmp_path_factory):
    """20 steps on one rank in bf16 and in fp32."""
    return {precision: run_training(_config(tmp_path_factory.mktemp(precision), precision=precision)).losses
            for precision in ("bf16", "fp32")}


def _relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _layout_case(name, schedule="1f1b", slow=False, **degrees):
    return pytest.param(degrees, schedule, id=name, marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("degrees, schedule", [
    _layout_case("fsdp2", fsdp=2),
    _layout_case("tp2xpp2-zbh1", "zbh1", slow=True, tp=2, pp=2),  # bf16 under pp: test_moe_odd_layouts (decision 153)
    _layout_case("dp2xtp2", slow=True, dp=2, tp=2),
    _layout_case("pp2-1f1b", slow=True, pp=2),
    _layout_case("pp2-zbh1", "zbh1", slow=True, pp=2),
])
def test_bf16_layouts_follow_one_rank(run_training, one_rank, tmp_path, degrees, schedule):
    losses = run_training(_config(tmp_path, ParallelLayout(**degrees), precision="bf16", schedule=schedule)).losses
    assert sorted(losses) == list(range(1, 21))
    worst = max(_relative(losses[step], one_rank["bf16"][step]) for step in losses)
    assert worst <= BF16_RTOL, (worst, losses, one_rank["bf16"])
    worst_fp32 = max(_relative(losses[step], one_rank["fp32"][step]) for step in losses)
    assert worst_fp32 <= FP32_RTOL, (worst_fp32, losses, one_rank["fp32"])
    assert losses[20] < losses[1] - 0.3  # it trained


def test_bf16_is_not_fp32(one_rank):
    """The flag is real: bf16 changes the numbers (by bf16's rounding, not by a bug's margin)."""
    differences = [_relative(one_rank["bf16"][step], one_rank["fp32"][step]) for step in one_rank["fp32"]]
    assert max(differences) > 1e-5
    assert max(differences) <= FP32_RTOL


@pytest.mark.parametrize("degrees, schedule", [
    _layout_case("fsdp2", fsdp=2),  # per-block checkpointing under FSDP2
    _layout_case("tp2xpp2-zbh1", "zbh1", slow=True, tp=2, pp=2),  # stage recompute under the I/W split (decision 153)
    _layout_case("tp2", slow=True, tp=2),
    _layout_case("pp2-1f1b", slow=True, pp=2),
    _layout_case("pp2-zbv", "zbv", slow=True, pp=2, vpp=2),
])
def test_activation_checkpointing_changes_no_bit(run_training, tmp_path, degrees, schedule):
    losses = {ac: run_training(_config(tmp_path / ac, ParallelLayout(**degrees), precision="bf16", schedule=schedule,
                                       steps=4, ac=ac)).losses
              for ac in ("none", "full", "selective")}
    assert losses["full"] == losses["none"]
    assert losses["selective"] == losses["none"]


@pytest.mark.parametrize("degrees, schedule, ac, precision", [
    # One rank compiled is also test_moe_compile's case (in the test process); the default run keeps tp2.
    pytest.param({}, "1f1b", "none", "fp32", id="one-rank", marks=pytest.mark.slow),
    # The first block's input is a view under TP, and full AC must wrap the compiled graph.
    pytest.param({"tp": 2}, "1f1b", "full", "fp32", id="tp2-full-ac", marks=pytest.mark.slow),  # decision 153
    pytest.param({"tp": 2, "pp": 2}, "1f1b", "full", "fp32", id="tp2xpp2-1f1b-full-ac", marks=pytest.mark.slow),
    pytest.param({"fsdp": 2, "tp": 2}, "1f1b", "selective", "bf16", id="fsdp2xtp2-bf16-selective", marks=pytest.mark.slow),
    pytest.param({"dp": 2, "pp": 2}, "interleaved1f1b", "selective", "fp32", id="dp2xpp2-interleaved-selective",
                 marks=pytest.mark.slow),
])
def test_compile_matches_eager(run_training, tmp_path, degrees, schedule, ac, precision):
    layout = ParallelLayout(**degrees, vpp=2 if schedule == "interleaved1f1b" else 1)
    common = dict(steps=3, schedule=schedule, ac=ac, precision=precision, microbatches=2)
    eager = run_training(_config(tmp_path / "eager", layout, **common)).losses
    compiled = run_training(_config(tmp_path / "compiled", layout, compile=True, **common)).losses
    tolerance = 1e-5 if precision == "fp32" else BF16_RTOL
    for step, loss in eager.items():
        assert math.isclose(compiled[step], loss, rel_tol=tolerance), (step, compiled[step], loss)


@pytest.mark.slow  # decision 153: test_bf16_on_one_data_rank_checkpoints_float32_and_resumes_bit_exact stays
def test_bf16_checkpoint_holds_fp32_master_state_and_resumes(run_training, tmp_path):
    layout = ParallelLayout(dp=2, tp=2)
    whole = run_training(_config(tmp_path, layout, precision="bf16", steps=6, ckpt_every=3, run="whole"))
    chunks, _ = read_manifest(Store(str(tmp_path / "store")).resolve("whole@3").url)
    dtypes = {chunk.dtype for chunk in chunks}
    assert dtypes == {"float32"}, dtypes  # master weights and AdamW moments, never the bf16 casts

    same = run_training(_config(tmp_path, layout, precision="bf16", steps=6, run="same", resume="whole@3"))
    assert {step: same.losses[step] for step in (4, 5, 6)} == {step: whole.losses[step] for step in (4, 5, 6)}

    # fp32 on another layout: the loaded state's digests equal the checkpoint's (verify_resume).
    other = run_training(_config(tmp_path, ParallelLayout(fsdp=2), steps=4, run="fp32", resume="whole@3",
                                 verify_resume=True))
    assert sorted(other.losses) == [4]
    assert _relative(other.losses[4], whole.losses[4]) <= FP32_RTOL


def test_bf16_on_one_data_rank_checkpoints_float32_and_resumes_bit_exact(run_training, tmp_path):
    """tp2 has one data rank: bf16 there is parameter casts without FSDP2 (decision 80); its
    checkpoints must still hold the float32 masters, never the casts, and resume bit-exact."""
    layout = ParallelLayout(tp=2)
    whole = run_training(_config(tmp_path, layout, precision="bf16", steps=4, ckpt_every=2, run="whole"))
    chunks, _ = read_manifest(Store(str(tmp_path / "store")).resolve("whole@2").url)
    assert {chunk.dtype for chunk in chunks} == {"float32"}
    same = run_training(_config(tmp_path, layout, precision="bf16", steps=4, run="same", resume="whole@2"))
    assert {step: same.losses[step] for step in (3, 4)} == {step: whole.losses[step] for step in (3, 4)}


def test_bf16_gradients_are_reduced_in_float32(rank_pool, tmp_path):
    """Each rank's gradient is computed in bf16; the reduction over data ranks adds them in
    float32, so the reduced gradient holds values bf16 cannot represent (a bf16 reduction would
    round every element back onto bf16's grid)."""
    from tests.integration.test_pipeline_numerics import one_step

    _, gradients = one_step(rank_pool, _config(tmp_path, ParallelLayout(fsdp=2), precision="bf16", microbatches=1))
    assert {gradient.dtype for gradient in gradients.values()} == {torch.float32}
    off_grid = sum(int((gradient != gradient.bfloat16().float()).sum()) for gradient in gradients.values())
    total = sum(gradient.numel() for gradient in gradients.values())
    assert off_grid > total // 10, (off_grid, total)
