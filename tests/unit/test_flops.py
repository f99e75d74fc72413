"""Model FLOPs per token, device peaks and MFU, against numbers worked out by hand."""
from __future__ import annotations

import pytest

from plans.training.flops import flops_per_token, peak_tflops, throughput
from plans.training.model_spec import preset


def test_flops_per_token_of_the_tiny_model_by_hand():
    # tiny: vocab 256, dim 64, 4 layers, 4 heads (head_dim 16) over 2 kv heads, ffn 160, untied.
    per_layer = 2 * 64 + (4 + 2 * 2) * 16 * 64 + 64 * 64 + 2 * 160 * 64 + 64 * 160  # norms, qkv, wo, gate_up, down
    parameters = 256 * 64 + 4 * per_layer + 64 + 256 * 64  # embedding, layers, norm, head
    assert flops_per_token(preset("tiny"), 32) == 6 * (parameters - 256 * 64) + 12 * 4 * 4 * 16 * 32


def test_tied_embeddings_leave_the_shared_weight_out_once():
    untied, tied = preset("tiny"), preset("tiny", tie_embeddings=True)
    assert flops_per_token(untied, 8) - flops_per_token(tied, 8) == 6 * 256 * 64


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.0), ("NVIDIA H100 NVL", "fp32", 60.0),
    ("NVIDIA H200", "bf16", 989.4), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5), ("cpu", "bf16", None),
    ("Tesla T4", "bf16", None),
])
def test_peaks_by_device_name(name, precision, peak):
    assert peak_tflops(name, precision) == peak


def test_mfu_is_model_flops_per_device_over_the_peak():
    model = preset("small")
    speed = throughput(model, 1024, tokens=8 * 1024 * 4, seconds=2.0, world_size=8, device_name="NVIDIA H100 80GB HBM3",
                       precision="bf16")
    assert speed.tokens_per_s == 16384 and speed.tokens_per_s_per_rank == 2048
    assert speed.tflops_per_rank == pytest.approx(2048 * flops_per_token(model, 1024) / 1e12)
    assert speed.mfu == pytest.approx(speed.tflops_per_rank / 989.4)
    cpu = throughput(model, 1024, 1000, 1.0, 1, "cpu", "fp32")
    assert cpu.mfu is None and cpu.describe().endswith("mfu n/a")
