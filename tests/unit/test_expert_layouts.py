"""The layout chooser, `plan layout` and elastic recovery know expert parallelism.

moe-tiny, by hand: dim 64, 4 layers of which 1 and 3 are MoE, 8 experts of 32 hidden units,
top-2, a shared expert of 64, vocab 256, untied head; 268,480 parameters. One MoE layer's stacked
experts: 8 * (2*32*64 + 64*32) = 49,152 (both MoE layers 98,304; the other 170,176 parameters are
attention, norms, router, shared expert, the dense layers' feed-forward and the root). The largest
block with its experts is an MoE block, 25,408 + 49,152 = 74,560; without them a dense block,
43,264. The root (embedding, head, final norm) is 32,832.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from rayshard.cluster.cli.main import build_parser, main
from rayshard.cluster.cli.commands.train import config_from_args
from rayshard.cluster.run.elastic import layout_chooser_for, runs_on
from rayshard.plans.config import ModelChoice, PipelineConfig, TrainConfig
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.chooser import Workload, choose_layout, estimate_memory, pinned_ranks
from rayshard.plans.layout.experts import ExpertFootprint, expert_degree, expert_parameters_per_layer, largest_block
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import check_experts_fit, parameter_count, preset

MIB = 2**20
FSDP2_EP2_TP2 = ParallelLayout(fsdp=2, ep=2, tp=2)


def test_the_hand_counts_of_moe_tiny():
    model = preset("moe-tiny")
    assert parameter_count(model) == 268_480
    assert expert_parameters_per_layer(model) == 49_152 and model.moe_layers == (1, 3)
    assert largest_block(model, with_experts=True) == 74_560
    assert largest_block(model, with_experts=False) == 43_264
    assert expert_parameters_per_layer(preset("tiny")) == 0


def test_expert_bytes_per_rank_on_fsdp2_ep2_tp2():
    # Each rank holds 4 of the 8 experts of both MoE layers, half of each expert's hidden units:
    # 98,304 / (2 * 2) = 24,576 elements, 16 bytes each (weight, gradient, two AdamW moments).
    footprint = ExpertFootprint.of(preset("moe-tiny"), FSDP2_EP2_TP2)
    assert (footprint.state, footprint.local_per_layer, footprint.gathered_per_layer) == (24_576, 12_288, 0)
    estimate = estimate_memory(preset("moe-tiny"), FSDP2_EP2_TP2, Workload(8, 32))
    assert estimate.experts == 16 * 24_576 == 393_216
    # The rest: 170,176 / (tp2 * fsdp2) = 42,544 elements of state; FSDP2 gathers (float32) the
    # largest block without experts, 43,264 / 2, and the root, 32,832 / 2.
    assert estimate.model_state == 16 * 42_544 + 393_216 + 4 * (21_632 + 16_416) == 1_226_112


def test_without_ep_fsdp_gathers_every_expert_with_its_block():
    # Same fsdp2 x tp2, ep pinned to 1: the expert state per rank is the same (FSDP2 shards dim 0
    # over the same two ranks), but the gathered block is now the MoE block, all 8 experts / tp.
    model, work = preset("moe-tiny"), Workload(8, 32)
    with_ep = estimate_memory(model, FSDP2_EP2_TP2, work)
    without = estimate_memory(model, ParallelLayout(fsdp=2, tp=2), work)
    assert without.experts == with_ep.experts == 393_216
    assert without.model_state == 16 * 42_544 + 393_216 + 4 * (74_560 / 2 + 16_416) == 1_288_704
    assert without.model_state - with_ep.model_state == 4 * (37_280 - 21_632)


def test_routed_activations_and_all_to_all_buffers():
    # 8 rows over 2 data ranks, 32 tokens each: 128 tokens, 512 bytes per value and token in fp32.
    # Dense layer: (12*64 + 3*160) / tp2 = 624 values per token. MoE layer: (12*64 + 3*64 shared
    # + 2*3*32 experts) / tp2 = 576, plus 2 * k * dim = 256 whole on each tp rank (the tokens'
    # two routed copies in, their two results out). Under ep one layer's receive buffers, 256,
    # come on top; logits and their gradient: 8 bytes * 128 tokens * 256 / tp2.
    model = preset("moe-tiny")
    layers = 2 * 512 * 624 + 2 * 512 * (576 + 256)
    logits = 8 * 128 * 256 // 2
    without = estimate_memory(model, ParallelLayout(fsdp=2, tp=2), Workload(8, 32))
    assert without.activations == layers + logits == 1_622_016
    with_ep = estimate_memory(model, FSDP2_EP2_TP2, Workload(8, 32))
    assert with_ep.activations == layers + 512 * 256 + logits == 1_753_088
    assert with_ep.assumes == "fp32, no activation recomputation, balanced routing"


def test_bf16_under_ep_casts_the_local_experts_once_per_layer_in_flight():
    # FSDP2's bf16 copies: (21,632 + 16,416) * 2 bytes; the experts, outside FSDP, are cast by
    # each MoE layer's forward: 12,288 local elements * 2 bytes, for both MoE layers.
    model = preset("moe-tiny")
    bf16 = estimate_memory(model, FSDP2_EP2_TP2, Workload(8, 32, precision="bf16"))
    assert bf16.model_state == 16 * 42_544 + 393_216 + 2 * 38_048 + 2 * 12_288 * 2 == 1_199_168
    recomputed = estimate_memory(model, FSDP2_EP2_TP2, Workload(8, 32, precision="bf16", ac="full"))
    assert bf16.model_state - recomputed.model_state == 2 * 12_288  # under AC one layer's cast at a time


def test_a_stage_counts_the_moe_layers_it_can_hold():
    # pp4 cuts moe-tiny one layer per stage: stages 1 and 3 each hold a whole MoE layer, so the
    # fullest rank holds one layer's experts, not half of the two.
    model = preset("moe-tiny")
    assert ExpertFootprint.of(model, ParallelLayout(pp=4)).state == 49_152
    assert ExpertFootprint.of(model, ParallelLayout(fsdp=2, ep=2, pp=2)).state == 49_152 / 2
    assert ExpertFootprint.of(model, ParallelLayout()).state == 98_304


def test_ep_follows_fsdp_where_it_divides_the_experts():
    moe = preset("moe-tiny")
    assert [expert_degree(moe, fsdp) for fsdp in (1, 2, 3, 4, 8, 16)] == [1, 2, 1, 4, 8, 1]
    assert [expert_degree(preset("tiny"), fsdp) for fsdp in (1, 2, 4)] == [1, 1, 1]


def test_tight_memory_shards_and_splits_the_experts():
    # 3 MiB on 4 ranks: fsdp4(ep4) needs ~2.80 MiB; dp2 x fsdp2(ep2) ~3.82 and dp4 ~5.93 do not fit.
    choice = choose_layout(4, preset("moe-tiny"), Workload(8, 32), 3 * MIB)
    assert choice.layout == ParallelLayout(fsdp=4, ep=4)
    text = choice.explain()
    assert "(fsdp4(ep4))" in text and "ep=4" in text.splitlines()[0]
    assert "ep=4: the 8 experts of each of the 2 MoE layers are split over the 4 fsdp ranks, 2 whole experts per rank" in text
    assert "expert weights, gradients and moments 0.38 MiB of the model state" in text


def test_fsdp_that_does_not_divide_the_experts_keeps_ep_1():
    choice = choose_layout(6, preset("moe-tiny"), Workload(6, 32), 64 * MIB, pinned={"fsdp": 3})
    assert choice.layout == ParallelLayout(dp=2, fsdp=3)
    assert "ep=1 (fsdp=3 does not divide the 8 experts)" in choice.explain()


def test_a_pinned_ep_is_honoured():
    model, work = preset("moe-tiny"), Workload(8, 32)
    assert choose_layout(4, model, work, 64 * MIB, pinned={"ep": 2}).layout == ParallelLayout(dp=2, fsdp=2, ep=2)
    kept_sharded = choose_layout(4, model, work, 64 * MIB, pinned={"fsdp": 4, "ep": 1})
    assert kept_sharded.layout == ParallelLayout(fsdp=4) and "ep=1 (pinned by you)" in kept_sharded.explain()
    assert pinned_ranks({"ep": 2}) == 2 and pinned_ranks({"ep": 2, "fsdp": 2, "tp": 2}) == 4


@pytest.mark.parametrize("model, pinned, message", [
    ("tiny", {"ep": 2}, "ep=2: expert parallelism needs a mixture-of-experts model"),
    ("moe-tiny", {"ep": 3}, r"ep=3: must divide the number of experts \(8\)"),
    ("moe-tiny", {"ep": 2, "fsdp": 4}, "ep=2: expert parallelism splits the experts over the fsdp ranks"),
    ("moe-tiny", {"ep": 4}, "the pinned dimensions need 4 ranks but only 2 are available"),
])
def test_a_pinned_ep_that_cannot_be_is_refused_in_one_line(model, pinned, message):
    with pytest.raises(ConfigError, match=message) as error:
        choose_layout(2, preset(model), Workload(8, 32), 64 * MIB, pinned=pinned)
    assert "\n" not in str(error.value) and "Fix: " in str(error.value)


def _six_experts():  # fsdp 4 does not divide them, 2, 3 and 6 do
    return preset("moe-tiny", n_experts=6, expert_ffn_dim=48)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(["moe-tiny", "moe-small", "six", "tiny"]), st.integers(1, 16), st.sampled_from([4, 6, 8, 12, 16]),
       st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from([0.1, 0.3, 1.0, 4.0]), st.booleans())
def test_every_choice_for_an_moe_model_holds_its_experts(name, ranks, batch, microbatches, vpp, budget_share, pin_ep_1):
    """Whatever the ranks, batch and budget (a share of what one rank would need), a chosen layout
    passes ParallelLayout's and check_experts_fit's validation and the training config's; its ep
    is fsdp exactly where fsdp divides the experts (1 for a dense model), unless pinned to 1."""
    model = _six_experts() if name == "six" else preset(name)
    work = Workload(batch, 64, microbatches)
    budget = estimate_memory(model, ParallelLayout(), work).total * budget_share
    try:
        choice = choose_layout(ranks, model, work, budget, pinned={"ep": 1} if pin_ep_1 else None, vpp=vpp)
    except ConfigError as error:
        assert "no layout of up to" in str(error)  # nothing fits the budget: said so, never a bad layout
        return
    layout = choice.layout
    check_experts_fit(model, layout)
    assert ParallelLayout.from_dict(layout.to_dict()) == layout
    assert layout.ep == (1 if pin_ep_1 else expert_degree(model, layout.fsdp))
    assert choice.estimate.total <= budget
    TrainConfig(model=ModelChoice(spec=model), layout=layout, global_batch=batch, seq_len=64,
                pipeline=PipelineConfig(schedule="interleaved1f1b" if layout.vpp > 1 else "1f1b",
                                        microbatches=microbatches)).validate()


def _moe_run(layout: ParallelLayout) -> TrainConfig:
    return TrainConfig(model=ModelChoice.named("moe-tiny"), layout=layout, global_batch=8, seq_len=32,
                       store="/tmp/unused", run="t").validate()


@pytest.mark.parametrize("ranks, budget, chosen", [
    (4, 3 * MIB, ParallelLayout(fsdp=4, ep=4)),  # grown and still tight: the experts spread over 4
    (4, 6 * MIB, ParallelLayout(dp=4)),  # grown with room: replicas, no fsdp, so no ep
    (1, 16 * MIB, ParallelLayout()),  # shrunk to one rank: ep 1
])
def test_elastic_recovery_moves_ep_with_fsdp(ranks, budget, chosen):
    config = _moe_run(ParallelLayout(fsdp=2, ep=2))  # trained on 2 ranks as fsdp2(ep2)
    layout = layout_chooser_for(config, {}, budget, ranks_per_node=8)(ranks).layout
    assert layout == chosen and runs_on(config, layout)


def test_elastic_recovery_keeps_a_pinned_ep_1_and_a_dense_run_never_gets_ep():
    layout = layout_chooser_for(_moe_run(ParallelLayout(fsdp=2)), {"ep": 1}, 3 * MIB, ranks_per_node=8)(4).layout
    assert layout.ep == 1 and layout.fsdp > 1
    dense = replace(_moe_run(ParallelLayout()), model=ModelChoice.named("tiny"))
    for ranks in (2, 4, 8):  # budgets that only sharded layouts meet: fsdp, and still no ep
        budget = estimate_memory(dense.model.spec, ParallelLayout(fsdp=ranks), Workload(8, 32)).total
        layout = layout_chooser_for(dense, {}, budget, ranks_per_node=8)(ranks).layout
        assert layout.fsdp > 1 and layout.ep == 1, layout


def test_plan_layout_shows_ep(capsys):
    flags = ["plan", "layout", "--ranks", "4", "--model", "moe-tiny", "--global-batch", "8", "--seq-len", "32"]
    assert main(flags + ["--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("layout dp=2,fsdp=2,tp=1,pp=1,vpp=1,ep=2 (dp2 x fsdp2(ep2)): 4 of 4 ranks")
    assert "pinned by you: ep=2" in out and "ep=2: the 8 experts" in out
    assert main(["plan", "layout", "--ranks", "4", "--model", "tiny", "--ep", "2"]) != 0
    err = capsys.readouterr().err
    assert "expert parallelism needs a mixture-of-experts model" in err and len(err.strip().splitlines()) == 1


def test_train_flag_ep_reaches_the_layout():
    args = build_parser().parse_args(["train", "--model", "moe-tiny", "--dp", "1", "--tp", "1", "--fsdp", "2", "--ep", "2",
                                      "--global-batch", "8", "--seq-len", "32"])
    assert config_from_args(args).layout == ParallelLayout(fsdp=2, ep=2)
