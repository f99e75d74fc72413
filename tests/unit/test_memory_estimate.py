"""The layout chooser's memory estimate knows precision and activation checkpointing."""
from __future__ import annotations

import pytest

from plans.errors import ConfigError
from plans.layout.chooser import Workload, choose_layout, estimate_memory
from plans.layout.parallel_layout import ParallelLayout
from plans.training.model_spec import preset

GIB = 2**30


def test_activation_bytes_by_hand_for_the_tiny_model():
    model, one_rank = preset("tiny"), ParallelLayout()  # dim 64, ffn 160, 4 layers, vocab 256
    tokens = 8 * 32
    block_fp32 = 4 * tokens * (12 * 64 + 3 * 160)  # everything a block keeps for its backward
    logits_fp32 = 8 * tokens * 256
    none = estimate_memory(model, one_rank, Workload(8, 32))
    assert none.activations == 4 * block_fp32 + logits_fp32
    bf16 = estimate_memory(model, one_rank, Workload(8, 32, precision="bf16"))
    assert bf16.activations == 4 * block_fp32 / 2 + 10 * tokens * 256  # bf16 logits, float32 copy, gradient
    full = estimate_memory(model, one_rank, Workload(8, 32, ac="full"))
    assert full.activations == 4 * (4 * tokens * 64) + block_fp32 + logits_fp32  # block inputs + one block recomputed
    selective = estimate_memory(model, one_rank, Workload(8, 32, ac="selective"))
    assert selective.activations == 4 * (4 * tokens * (5 * 64 + 2 * 160) + 4 * tokens * 64) + logits_fp32
    assert full.activations < selective.activations < none.activations
    assert (none.assumes, bf16.assumes, full.assumes) == (
        "fp32, no activation recomputation", "bf16, no activation recomputation", "fp32, full activation checkpointing")
    # The master state stays float32: bf16 only adds the gathered block's bf16 copy.
    assert bf16.model_state > none.model_state


def test_a_layout_fits_only_with_bf16_and_recomputation():
    model, budget = preset("small"), 2 * GIB
    work = dict(global_batch=64, seq_len=2048)
    with pytest.raises(ConfigError, match="no layout of up to 4 ranks fits"):
        choose_layout(4, model, Workload(**work), budget)
    choice = choose_layout(4, model, Workload(**work, precision="bf16", ac="full"), budget)
    assert choice.estimate.total <= budget
    assert "assuming bf16, full activation checkpointing" in choice.explain()
