"""Model FLOPs per token, device peaks and MFU, against numbers worked out by hand."""
from __future__ import annotations

import pytest

from rayshard.plans.training.flops import flops_per_token, peak_tflops, throughput
from rayshard.plans.training.model_spec import preset


def test_flops_per_token_of_the_tiny_model_by_hand():
    # tiny: vocab 256, dim 64, 4 layers, 4 heads (head_dim 16) over 2 kv heads, ffn 160, untied.
    per_layer = 2 * 64 + (4 + 2 * 2) * 16 * 64 + 64 * 64 + 2 * 160 * 64 + 64 * 160  # norms, qkv, wo, gate_up, down
    parameters = 256 * 64 + 4 * per_layer + 64 + 256 * 64  # embedding, layers, norm, head
    assert per_layer == 43_136 and parameters == 205_376
    # 6 x 188,992 non-embedding parameters + 12 x 4 layers x 4 heads x 16 x 32 positions
    assert flops_per_token(preset("tiny"), 32) == 6 * (parameters - 256 * 64) + 12 * 4 * 4 * 16 * 32 == 1_232_256


def test_tied_embeddings_leave_the_shared_weight_out_once():
    untied, tied = preset("tiny"), preset("tiny", tie_embeddings=True)
    assert flops_per_token(untied, 8) - flops_per_token(tied, 8) == 6 * 256 * 64


def test_an_moe_model_counts_the_experts_a_token_runs_through_by_hand():
    # moe-tiny: the tiny shapes with q/k/v biases; layers 1 and 3 MoE: a router over 8 experts of
    # 32 hidden units, top-2, and a shared expert of 64 (with its 1-wide gate); layers 0 and 2 dense.
    attention = 2 * 64 + (4 + 2 * 2) * 16 * (64 + 1) + 64 * 64  # norms, qkv weight and bias, wo
    dense = 2 * 160 * 64 + 64 * 160
    routed = 8 * (2 * 32 * 64 + 64 * 32)  # every expert's gate_up and down: a token meets 2 of 8
    moe_active = 8 * 64 + routed * 2 // 8 + (2 * 64 * 64 + 64 * 64 + 64)  # router, 2 experts, shared
    active = 4 * attention + 2 * dense + 2 * moe_active + 64 + 256 * 64  # final norm, untied head
    assert active == 178_368
    assert flops_per_token(preset("moe-tiny"), 32) == 6 * active + 12 * 4 * 4 * 16 * 32 == 1_168_512
    # Counting every expert (top-8 of 8) adds 6 x 36,864 FLOPs per token in each of the two MoE layers.
    assert flops_per_token(preset("moe-tiny", experts_per_token=8), 32) - flops_per_token(preset("moe-tiny"), 32) == 6 * 2 * (routed - routed // 4)


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H100 NVL", "fp32", 60.0),
    ("NVIDIA H200", "bf16", 989.4), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5), ("cpu", "bf16", None),
    ("Tesla T4", "bf16", None),
])
def test_peaks_by_device_name(name, precision, peak):
    assert peak_tflops(name, precision) == peak


def test_mfu_by_hand():
    # 1,232,256 FLOPs per token; 8 ranks train 4 x 10^9 tokens in 2 s: 2.5 x 10^8 tokens/s per rank,
    # 308.064 TFLOP/s per rank, which is 31.1% of an H100's dense bf16 peak of 989.4.
    speed = throughput(preset("tiny"), 32, tokens=4_000_000_000, seconds=2.0, world_size=8,
                       device_name="NVIDIA H100 80GB HBM3", precision="bf16")
    assert speed.tokens_per_s == 2_000_000_000 and speed.tokens_per_s_per_rank == 250_000_000
    assert speed.tflops_per_rank == pytest.approx(308.064)
    assert speed.mfu == pytest.approx(0.311364463, rel=1e-8)
    assert speed.describe() == "2,000,000,000 tok/s (250,000,000/rank) | 308 TFLOP/s/rank | mfu 31.1%"


def test_mfu_is_model_flops_per_device_over_the_peak():
    model = preset("small")
    speed = throughput(model, 1024, tokens=8 * 1024 * 4, seconds=2.0, world_size=8, device_name="NVIDIA H100 80GB HBM3",
                       precision="bf16")
    assert speed.tokens_per_s == 16384 and speed.tokens_per_s_per_rank == 2048
    assert speed.tflops_per_rank == pytest.approx(2048 * flops_per_token(model, 1024) / 1e12)
    assert speed.mfu == pytest.approx(speed.tflops_per_rank / 989.4)
    cpu = throughput(model, 1024, 1000, 1.0, 1, "cpu", "fp32")
    assert cpu.mfu is None and cpu.describe().endswith("mfu n/a")


def test_padded_rows_count_their_tokens_per_second_and_their_computed_positions_in_mfu():
    """An SFT or DPO step's rows are padded: tokens/s counts the examples' tokens, MFU the FLOPs
    of every position the devices ran (decision 203)."""
    model = preset("small")
    speed = throughput(model, 1024, tokens=3000, seconds=2.0, world_size=2, device_name="NVIDIA H100 80GB HBM3",
                       precision="bf16", computed_tokens=8192)
    assert speed.tokens_per_s == 1500 and speed.tokens_per_s_per_rank == 750
    assert speed.tflops_per_rank == pytest.approx(2048 * flops_per_token(model, 1024) / 1e12)
    assert speed.mfu == pytest.approx(speed.tflops_per_rank / 989.4)
