"""The layout chooser's memory estimate knows precision and activation checkpointing."""
from __future__ import annotations

import pytest

from rayshard.cluster.cli.main import main
from rayshard.cluster.run.elastic import layout_chooser_for
from rayshard.plans.config import ModelChoice, NumericsConfig, TrainConfig
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.chooser import Workload, choose_layout, estimate_memory
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import preset

GIB = 2**30


def test_activation_bytes_by_hand_for_the_tiny_model():
    model, one_rank = preset("tiny"), ParallelLayout()  # dim 64, ffn 160, 4 layers, vocab 256
    tokens = 8 * 32
    block_fp32 = 4 * tokens * (12 * 64 + 3 * 160)  # everything a block keeps for its backward: 1,277,952 bytes
    logits_fp32 = 8 * tokens * 256  # logits and their gradient
    none = estimate_memory(model, one_rank, Workload(8, 32))
    assert none.activations == 4 * block_fp32 + logits_fp32 == 5_636_096
    bf16 = estimate_memory(model, one_rank, Workload(8, 32, precision="bf16"))
    assert bf16.activations == 4 * block_fp32 / 2 + 10 * tokens * 256  # bf16 logits, float32 copy, gradient
    assert none.activations - bf16.activations == 2_555_904 - 131_072  # blocks halve; logits gain a bf16 copy
    full = estimate_memory(model, one_rank, Workload(8, 32, ac="full"))
    assert full.activations == 4 * (4 * tokens * 64) + block_fp32 + logits_fp32  # block inputs + one block recomputed
    assert none.activations - full.activations == 3 * block_fp32 - 4 * 4 * tokens * 64 == 3_571_712
    selective = estimate_memory(model, one_rank, Workload(8, 32, ac="selective"))
    assert selective.activations == 4 * (4 * tokens * (5 * 64 + 2 * 160) + 4 * tokens * 64) + logits_fp32
    assert full.activations < selective.activations < none.activations
    assert (none.assumes, bf16.assumes, full.assumes) == (
        "fp32, no activation recomputation", "bf16, no activation recomputation", "fp32, full activation checkpointing")


def test_a_vocabulary_tp_does_not_divide_counts_the_fullest_ranks_rows():
    """1001 ids on tp4 are cut 251 + 251 + 251 + 248 (decision 118): the estimate is the first
    rank's, 251 rows of logits (and their gradient), not 1001 / 4."""
    tokens, layout = 8 * 32, ParallelLayout(tp=4)
    odd, even = preset("tiny", vocab_size=1001), preset("tiny", vocab_size=1004)  # 1004 = 4 x 251
    assert estimate_memory(odd, layout, Workload(8, 32)).activations == \
        estimate_memory(even, layout, Workload(8, 32)).activations
    assert estimate_memory(odd, layout, Workload(8, 32, precision="bf16")).activations == \
        estimate_memory(even, layout, Workload(8, 32, precision="bf16")).activations
    assert (estimate_memory(odd, layout, Workload(8, 32)).activations
            - estimate_memory(preset("tiny", vocab_size=1000), layout, Workload(8, 32)).activations) == 8 * tokens * 1


def test_model_state_by_hand_for_the_tiny_model():
    # 205,376 parameters; the root (embedding 16,384 + head 16,384 + final norm 64) is 32,832,
    # each of the 4 blocks 43,136.
    model = preset("tiny")
    fp32 = estimate_memory(model, ParallelLayout(), Workload(8, 32))
    assert fp32.model_state == 16 * 205_376  # float32 weight, gradient, two moments; no FSDP on one fp32 rank
    # bf16 keeps all of that and adds FSDP2's bf16 working copies: one block plus the root.
    bf16 = estimate_memory(model, ParallelLayout(), Workload(8, 32, precision="bf16"))
    assert bf16.model_state - fp32.model_state == 2 * (43_136 + 32_832)
    # A pipeline stage keeps its whole shard gathered: half the parameters in bf16, next to a
    # float32 state that is half of the model's as well.
    staged = estimate_memory(model, ParallelLayout(pp=2), Workload(8, 32, precision="bf16"))
    assert staged.model_state == 16 * 205_376 / 2 + 2 * 205_376 / 2
    # fsdp2 in fp32 shards the state and gathers one block plus the root in float32.
    sharded = estimate_memory(model, ParallelLayout(fsdp=2), Workload(8, 32))
    assert sharded.model_state == 16 * 205_376 / 2 + 4 * (43_136 + 32_832)


@pytest.mark.parametrize("precision, ac", [("bf16", "none"), ("fp32", "full"), ("fp32", "selective")])
def test_one_rank_fits_only_because_of_bf16_or_recomputation(precision, ac):
    # small, batch 8 x 1024 on one rank: ~3.02 GiB in fp32 with every activation kept; bf16
    # ~1.72, full AC ~0.85, selective ~1.90.
    model, budget, work = preset("small"), 2 * GIB, dict(global_batch=8, seq_len=1024)
    with pytest.raises(ConfigError, match="no layout of up to 1 ranks fits"):
        choose_layout(1, model, Workload(**work), budget)
    choice = choose_layout(1, model, Workload(**work, precision=precision, ac=ac), budget)
    assert choice.layout == ParallelLayout() and choice.estimate.total <= budget
    assert f"assuming {precision}, " in choice.explain()


def test_a_layout_fits_only_with_bf16_and_recomputation():
    model, budget = preset("small"), 2 * GIB
    work = dict(global_batch=64, seq_len=2048)
    with pytest.raises(ConfigError, match="no layout of up to 4 ranks fits"):
        choose_layout(4, model, Workload(**work), budget)
    choice = choose_layout(4, model, Workload(**work, precision="bf16", ac="full"), budget)
    assert choice.estimate.total <= budget
    assert "assuming bf16, full activation checkpointing" in choice.explain()


def test_plan_layout_says_what_it_assumes(capsys):
    flags = ["plan", "layout", "--ranks", "1", "--model", "small", "--global-batch", "8", "--seq-len", "1024",
             "--memory-gib", "2"]
    assert main(flags + ["--precision", "bf16", "--ac", "selective"]) == 0
    assert "assuming bf16, selective activation checkpointing" in capsys.readouterr().out
    assert main(flags) != 0  # fp32 with every activation kept does not fit 2 GiB
    assert "no layout of up to 1 ranks fits" in capsys.readouterr().err


def test_elastic_recovery_chooses_with_the_runs_precision_and_ac():
    run = dict(model=ModelChoice.named("small"), global_batch=8, seq_len=1024)
    with pytest.raises(ConfigError, match="fits 2.00 GiB"):
        layout_chooser_for(TrainConfig(**run), {}, 2 * GIB, 8)(1)
    choice = layout_chooser_for(TrainConfig(**run, numerics=NumericsConfig(precision="bf16", ac="full")), {}, 2 * GIB,
                                8)(1)
    assert "assuming bf16, full activation checkpointing" in choice.explain()
