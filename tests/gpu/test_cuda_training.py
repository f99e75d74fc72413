"""The CUDA/NCCL path, through the real CLI and Ray: a rank that owns a GPU trains, saves, loads
and hands its checkpoints to CPU/gloo ranks and back, bit for bit.

Runs only where torch sees a CUDA GPU (CI has none; bench/RESULTS.md records the runs on a
lent GPU machine). One GPU is enough: NCCL refuses two ranks on one device, so the GPU side is
one rank and the layout changes happen on the CPU side (`CUDA_VISIBLE_DEVICES=` hides the GPU
from Ray, whose ranks then take CPU shares and gloo).

    python -m pytest tests/gpu -q
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rayshard.cluster.checkpoint.digest import checkpoint_digest, digest_checkpoint

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS, CKPT_EVERY = 8, 4
# fp32 on a GPU (cuBLAS, TF32 off as torch defaults) and on a CPU round differently; over a few
# AdamW steps the losses drift apart at the 1e-6 level. Data movement is compared bit for bit.
LOSS_RTOL = 1e-4


def _train(store: str, run: str, *flags: str, gpu: bool) -> str:
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    command = [sys.executable, "-m", "rayshard", "train", "--config", "configs/demo.yaml", "--store", store,
               "--run", run, "--steps", str(STEPS), "--ckpt-every", str(CKPT_EVERY), *flags]
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done.stdout


def _losses(store: str, run: str) -> dict[int, float]:
    with open(os.path.join(store, run, "metrics.jsonl")) as handle:
        return {record["step"]: record["loss"] for record in map(json.loads, filter(str.strip, handle))}


def _digest(store: str, run: str, step: int) -> str:
    return checkpoint_digest(digest_checkpoint(os.path.join(store, run, "checkpoints", f"step-{step:08d}")))


def _assert_losses_close(actual: dict[int, float], expected: dict[int, float], steps) -> None:
    for step in steps:
        assert actual[step] == pytest.approx(expected[step], rel=LOSS_RTOL), (step, actual[step], expected[step])


SINGLE = ("--dp", "1", "--tp", "1")


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("gpu-store"))


@pytest.fixture(scope="module")
def gpu_run(store) -> str:
    """One rank on the GPU, fp32; 8 steps, checkpoints at 4 and 8. Its own fixture, apart from the
    CPU run, so the bf16 checks (the first a lent machine's short budget runs) start one process
    fewer (tests/gpu/device_check.sh)."""
    return _train(store, "gpu", *SINGLE, gpu=True)


@pytest.fixture(scope="module")
def cpu_run(store) -> str:
    """The same config on one CPU rank."""
    return _train(store, "cpu", *SINGLE, gpu=False)


@pytest.fixture(scope="module")
def runs(store, gpu_run, cpu_run):
    return store, {"gpu": gpu_run, "cpu": cpu_run}


def test_a_gpu_rank_trains_on_nccl_like_a_cpu_rank(runs):
    store, logs = runs
    assert "rank actors ready on cuda:0" in logs["gpu"], logs["gpu"][-2000:]
    assert "rank actors ready on cpu" in logs["cpu"]
    gpu, cpu = _losses(store, "gpu"), _losses(store, "cpu")
    assert sorted(gpu) == list(range(1, STEPS + 1))
    _assert_losses_close(gpu, cpu, range(1, STEPS + 1))
    assert gpu != cpu, "the GPU run should not round exactly like the CPU one: was it on the GPU?"


def test_a_gpu_checkpoint_resumes_on_cpu_ranks_in_another_layout_exactly(runs):
    """Saved from CUDA tensors (staged to CPU block by block), loaded by dp2 x tp2 gloo ranks."""
    store, _ = runs
    log = _train(store, "gpu-to-cpu", "--resume", f"gpu@{CKPT_EVERY}", "--dp", "2", "--tp", "2",
                 "--verify-resume", gpu=False)
    assert "resumed state verified" in log
    assert _digest(store, "gpu-to-cpu", STEPS) != _digest(store, "gpu", STEPS)  # trained on, on CPUs
    _assert_losses_close(_losses(store, "gpu-to-cpu"), _losses(store, "gpu"), range(CKPT_EVERY + 1, STEPS + 1))


def test_a_cpu_checkpoint_resumes_on_the_gpu_exactly(runs):
    """Loaded into CUDA tensors (reads staged on the CPU, then copied); the re-save's digests
    equal the checkpoint's, so every byte reached the GPU intact."""
    store, _ = runs
    log = _train(store, "cpu-to-gpu", "--resume", f"cpu@{CKPT_EVERY}", "--dp", "1", "--tp", "1",
                 "--verify-resume", gpu=True)
    assert "rank actors ready on cuda:0" in log and "resumed state verified" in log
    _assert_losses_close(_losses(store, "cpu-to-gpu"), _losses(store, "cpu"), range(CKPT_EVERY + 1, STEPS + 1))


def test_an_async_save_from_the_gpu_holds_the_state_of_its_step(runs):
    """The snapshot copy runs on a side CUDA stream while the next step computes; what it
    uploaded must be the state at the checkpoint's step, not a later one. GPU training is
    deterministic here (same kernels, same order), so the sync run's checkpoint is the reference."""
    store, _ = runs
    log = _train(store, "gpu-async", "--dp", "1", "--tp", "1", "--async-save", gpu=True)
    assert "rank actors ready on cuda:0" in log
    assert _losses(store, "gpu-async") == _losses(store, "gpu")
    for step in (CKPT_EVERY, STEPS):
        assert _digest(store, "gpu-async", step) == _digest(store, "gpu", step), step


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    """bf16 + compile + selective AC on the GPU, saved synchronously and asynchronously (the
    async save stages through pinned host buffers on a side stream)."""
    store = str(tmp_path_factory.mktemp("gpu-bf16"))
    fast = ("--dp", "1", "--tp", "1", "--precision", "bf16", "--compile", "--ac", "selective")
    logs = {"sync": _train(store, "bf16", *fast, gpu=True),
            "async": _train(store, "bf16-async", *fast, "--async-save", gpu=True)}
    return store, logs


def test_bf16_compile_and_ac_train_on_the_gpu(bf16_runs, store, gpu_run):
    bf16_store, logs = bf16_runs
    assert "rank actors ready on cuda:0" in logs["sync"]
    losses, fp32 = _losses(bf16_store, "bf16"), _losses(store, "gpu")
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step in losses:  # bf16 follows fp32 within bf16's rounding
        assert losses[step] == pytest.approx(fp32[step], rel=5e-2), (step, losses[step], fp32[step])
    assert losses != fp32


def test_a_bf16_async_save_through_pinned_memory_holds_its_steps_state(bf16_runs):
    store, _ = bf16_runs
    assert _losses(store, "bf16-async") == _losses(store, "bf16")
    for step in (CKPT_EVERY, STEPS):
        assert _digest(store, "bf16-async", step) == _digest(store, "bf16", step), step


def test_a_bf16_gpu_checkpoint_resumes_on_cpu_ranks_with_its_fp32_master_state(bf16_runs):
    """The checkpoint holds float32 master weights and moments: CPU ranks on fsdp2 load them in
    fp32 and the re-save's digests equal the checkpoint's (--verify-resume)."""
    store, _ = bf16_runs
    log = _train(store, "bf16-to-cpu", "--resume", f"bf16@{CKPT_EVERY}", "--dp", "1", "--fsdp", "2", "--tp", "1",
                 "--precision", "fp32", "--verify-resume", gpu=False)
    assert "resumed state verified" in log


def test_an_moe_model_trains_on_the_gpu_and_resumes_with_experts_split_over_cpu_ranks(tmp_path):
    """moe-tiny on one GPU rank (routing, the balance loss and the routing statistics' all-reduce
    on NCCL, in bf16), then its float32 checkpoint on fsdp2(ep2) gloo ranks: experts split over
    the two ranks, digests equal to the checkpoint's, training continues."""
    store = str(tmp_path)
    moe = ("--model", "moe-tiny", "--dp", "1", "--tp", "1")
    log = _train(store, "moe-gpu", *moe, "--precision", "bf16", gpu=True)
    assert "rank actors ready on cuda:0" in log and "expert load max/mean" in log
    log = _train(store, "moe-to-cpu", "--resume", f"moe-gpu@{CKPT_EVERY}", "--model", "moe-tiny", "--fsdp", "2",
                 "--ep", "2", "--precision", "fp32", "--verify-resume", gpu=False)
    assert "resumed state verified" in log
    assert sorted(_losses(store, "moe-to-cpu")) == list(range(CKPT_EVERY + 1, STEPS + 1))
