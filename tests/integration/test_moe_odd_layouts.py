"""Mixture of experts on the shapes and layouts the main tests leave out: odd expert counts over
three ranks, top-k at its two ends, pipeline stages with no MoE layer, tied embeddings and bf16
under pp, and a step where some rank's experts receive no token at all.

Each case compares one step (loss and every full gradient) with one rank on the same model and
batch, fp32 tolerances as `test_moe_training.py` uses."""
from __future__ import annotations

import math

import pytest
import torch

from rayshard.plans.config import ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import preset
from tests.conftest import small_config
from tests.integration.test_pipeline_numerics import ATOL, RTOL, one_step


def _config(tmp_path, layout, model, **overrides):
    values = dict(model=ModelChoice("moe-tiny", model), global_batch=12, seq_len=8, steps=1, run="odd")
    return small_config(tmp_path, layout, **{**values, **overrides})


def _equals_one_rank(rank_pool, tmp_path, layout, model, **overrides):
    reference_loss, reference = one_step(rank_pool, _config(tmp_path / "one", ParallelLayout(), model, **overrides))
    loss, gradients = one_step(rank_pool, _config(tmp_path / "split", layout, model, **overrides))
    assert math.isclose(loss, reference_loss, rel_tol=1e-6), (loss, reference_loss)
    assert gradients.keys() == reference.keys()
    for key, gradient in gradients.items():
        torch.testing.assert_close(gradient, reference[key], rtol=RTOL, atol=ATOL, msg=key)
    return reference


CASES = {
    # Three ranks: experts 2 a rank, and every dense weight FSDP-sharded unevenly (64 rows over 3).
    "6experts-fsdp3(ep3)": (ParallelLayout(fsdp=3, ep=3), dict(n_experts=6)),
    # Every token to every expert: each rank receives all its peers' tokens for each local expert.
    "topk=experts-fsdp2(ep2)": (ParallelLayout(fsdp=2, ep=2), dict(experts_per_token=8)),
    # Layer 2 alone is MoE: stage 0 (layers 0-1) holds no expert, stage 1 holds them all.
    "moe_every3-fsdp2(ep2)xpp2": (ParallelLayout(fsdp=2, ep=2, pp=2), dict(moe_every=3)),
    # Every layer MoE: each stage holds nothing but MoE layers.
    "moe_every1-fsdp2(ep2)xpp2": (ParallelLayout(fsdp=2, ep=2, pp=2), dict(moe_every=1)),
    # Tied embeddings across two stages with experts split on each.
    "tied-fsdp2(ep2)xpp2": (ParallelLayout(fsdp=2, ep=2, pp=2), dict(tie_embeddings=True)),
    # ep = 1: every expert on every rank, FSDP2 shards the stacked weights with the rest and tp
    # splits each expert's hidden units (the tp dispatch adds the partial results).
    "fsdp2xtp2(ep1)": (ParallelLayout(fsdp=2, tp=2), dict()),
    # FSDP2 cuts dim 0 of 6 stacked experts in blocks of 2 over 4 ranks: rank 3 holds none.
    "6experts-fsdp4(ep1)": (ParallelLayout(fsdp=4), dict(n_experts=6)),
}
# Layouts with training options on top (the one-rank reference runs without them): two
# microbatches accumulating the experts' gradients outside FSDP, and selective activation
# checkpointing, which saves the token all-to-alls and recomputes the count exchange.
WITH_OPTIONS = {
    "microbatches2-selective-ac-fsdp2(ep2)xtp2": (ParallelLayout(fsdp=2, ep=2, tp=2), dict(microbatches=2, ac="selective")),
}
SLOW_CASES = {
    "12experts-fsdp3(ep3)xtp2": (ParallelLayout(fsdp=3, ep=3, tp=2), dict(n_experts=12)),
    "dp2xfsdp2(ep2)xpp2": (ParallelLayout(dp=2, fsdp=2, ep=2, pp=2), dict()),
    "tied-fsdp2(ep2)xpp2xvpp2": (ParallelLayout(fsdp=2, ep=2, pp=2, vpp=2), dict(tie_embeddings=True)),
    "dp2xtp2xpp2(ep1)": (ParallelLayout(dp=2, tp=2, pp=2), dict()),
    # Experts copied over dp and split over tp: the trainer's dp all-reduce runs per tp shard.
    "dp2xfsdp2(ep2)xtp2": (ParallelLayout(dp=2, fsdp=2, ep=2, tp=2), dict()),
    # One expert a rank.
    "fsdp8(ep8)": (ParallelLayout(fsdp=8, ep=8), dict()),
}


@pytest.mark.parametrize("name", list(CASES) + [pytest.param(name, marks=pytest.mark.slow) for name in SLOW_CASES])
def test_one_step_equals_one_rank(rank_pool, tmp_path, name):
    layout, fields = {**CASES, **SLOW_CASES}[name]
    model = preset("moe-tiny", **fields)
    overrides = dict(global_batch=8) if layout.data_parallel_size in (2, 4, 8) else {}
    if layout.pp > 1:
        overrides.update(microbatches=2, schedule="interleaved1f1b" if layout.vpp > 1 else "1f1b")
    _equals_one_rank(rank_pool, tmp_path, layout, model, **overrides)


# One token per rank, each to one expert of eight over four ranks: at least one rank's two experts
# get no token (the run's logged tokens per expert show which), so its all-to-all receives nothing.
STARVED = preset("moe-tiny", experts_per_token=1)
STARVED_LAYOUT = ParallelLayout(fsdp=4, ep=4)


@pytest.mark.parametrize("name", list(WITH_OPTIONS))
def test_one_step_with_training_options_equals_one_rank(rank_pool, tmp_path, name):
    layout, options = WITH_OPTIONS[name]
    model = preset("moe-tiny")
    reference_loss, reference = one_step(rank_pool, _config(tmp_path / "one", ParallelLayout(), model, global_batch=8))
    loss, gradients = one_step(rank_pool, _config(tmp_path / "split", layout, model, global_batch=8, **options))
    assert math.isclose(loss, reference_loss, rel_tol=1e-6), (loss, reference_loss)
    assert gradients.keys() == reference.keys()
    for key, gradient in gradients.items():
        torch.testing.assert_close(gradient, reference[key], rtol=RTOL, atol=ATOL, msg=key)


def test_a_rank_whose_experts_get_no_token_equals_one_rank(rank_pool, run_training, tmp_path):
    overrides = dict(global_batch=4, seq_len=1)
    reference = _equals_one_rank(rank_pool, tmp_path, STARVED_LAYOUT, STARVED, **overrides)
    # The same weights and batch as the step above: the run's first step logs its routing.
    run = run_training(_config(tmp_path / "run", STARVED_LAYOUT, STARVED, **overrides))
    for layer, counts in run.expert_tokens[1].items():
        per_rank = [sum(counts[rank * 2:rank * 2 + 2]) for rank in range(4)]
        assert sum(per_rank) == 4 and 0 in per_rank, (layer, counts)
    unused = [name for name, gradient in reference.items() if ".experts." in name and not gradient.abs().sum()]
    assert not unused  # every expert tensor still has a gradient from its used experts


def test_bf16_with_ep_under_pp_follows_fp32(run_training, tmp_path):
    """bf16 under pp: the experts (outside FSDP) cast by the layer, stage activations in bf16."""
    layout = ParallelLayout(fsdp=2, ep=2, pp=2)
    model = preset("moe-tiny")
    fp32 = run_training(_config(tmp_path / "fp32", ParallelLayout(), model, global_batch=8, steps=3))
    bf16 = run_training(_config(tmp_path / "bf16", layout, model, global_batch=8, steps=3, precision="bf16",
                                microbatches=2, schedule="1f1b"))
    for step, loss in fp32.losses.items():
        assert math.isclose(bf16.losses[step], loss, rel_tol=2e-2), (step, bf16.losses[step], loss)


def test_six_experts_on_three_ranks_move_bit_exact(run_training, rank_pool, tmp_path):
    """A checkpoint of 6 experts written on fsdp3(ep3) (2 experts a rank, the dense weights cut
    unevenly by FSDP2) loads into fsdp2(ep2) x tp2, fsdp6(ep6) (one expert a rank) and fsdp4 (ep 1) and is
    saved back with every tensor and moment bit-identical; offline to one rank and back too."""
    from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint
    from rayshard.cluster.checkpoint.verify import verify
    from rayshard.cluster.catalog.store import Store
    from tests.integration.reshard_helpers import chunk_fingerprint, digests, load_and_save

    model = preset("moe-tiny", n_experts=6)
    source = ParallelLayout(fsdp=3, ep=3)
    url = run_training(_config(tmp_path, source, model, steps=2, run="src")).checkpoints[-1]
    expected = digests(url)
    # fsdp4 without ep: FSDP2's blocks of 2 experts leave the last rank none of them.
    for run, layout in (("to-ep2-tp2", ParallelLayout(fsdp=2, ep=2, tp=2)), ("to-ep6", ParallelLayout(fsdp=6, ep=6)),
                        ("to-fsdp4", ParallelLayout(fsdp=4))):
        there = load_and_save(_config(tmp_path, layout, model, run=run), url, rank_pool)
        assert digests(there) == expected, run
        assert not verify(there).problems, run  # the fsdp4 save holds an empty expert piece: still whole
    store = Store(str(tmp_path / "store"))
    there = reshard_checkpoint(url, ParallelLayout(), store, "to-one", local=True, log=lambda *_: None).url
    assert digests(there) == expected
    back = reshard_checkpoint(there, source, store, "back", local=True, log=lambda *_: None).url
    assert chunk_fingerprint(back) == chunk_fingerprint(url)


def test_steps_with_a_stage_without_experts_follow_one_rank(run_training, tmp_path):
    """The whole step, not only the gradients: clipping, AdamW and the routing statistics with
    pipeline stage 0 holding no MoE layer (its rows of the statistics table stay empty) and the
    tied embedding's copy on the last stage."""
    model = preset("moe-tiny", moe_every=3, tie_embeddings=True)
    one = run_training(_config(tmp_path / "one", ParallelLayout(), model, global_batch=8, steps=3))
    split = run_training(_config(tmp_path / "split", ParallelLayout(fsdp=2, ep=2, pp=2), model, global_batch=8, steps=3,
                                 microbatches=2, schedule="1f1b"))
    assert sorted(split.losses) == [1, 2, 3]
    for step, loss in one.losses.items():
        assert math.isclose(split.losses[step], loss, rel_tol=1e-5), (step, split.losses[step], loss)
    assert split.expert_tokens == one.expert_tokens and sorted(one.expert_tokens[1]) == [2]


@pytest.mark.slow  # inductor compiles every block on each rank
def test_compiled_blocks_with_ep_match_eager(run_training, tmp_path):
    """torch.compile per block around an MoE layer whose split sizes change every step."""
    layout, model = ParallelLayout(fsdp=2, ep=2), preset("moe-tiny")
    eager = run_training(_config(tmp_path / "eager", layout, model, global_batch=8, steps=3)).losses
    compiled = run_training(_config(tmp_path / "compiled", layout, model, global_batch=8, steps=3, compile=True)).losses
    for step, loss in eager.items():
        assert math.isclose(compiled[step], loss, rel_tol=1e-5), (step, compiled[step], loss)


def _aux_losses(tmp_path) -> list[float]:
    import json

    lines = (tmp_path / "store" / "odd" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["aux_loss"] for line in lines]


@pytest.fixture(scope="module")
def one_rank_aux_losses(run_training, tmp_path_factory) -> list[float]:
    """The one-rank run both layouts below are held to, trained once (decision 208)."""
    root = tmp_path_factory.mktemp("aux-one")
    run_training(_config(root, ParallelLayout(), preset("moe-tiny"), global_batch=8, steps=2))
    return _aux_losses(root)


@pytest.mark.parametrize("name, layout, options", [
    ("fsdp2(ep2)xtp2-microbatches2", ParallelLayout(fsdp=2, ep=2, tp=2), dict(microbatches=2)),
    ("fsdp2(ep2)xpp2xvpp2-zbv", ParallelLayout(fsdp=2, ep=2, pp=2, vpp=2), dict(microbatches=2, schedule="zbv")),
])
def test_the_logged_balance_loss_is_the_one_ranks(run_training, one_rank_aux_losses, tmp_path, name, layout, options):
    """metrics.jsonl's aux_loss, averaged over data ranks, microbatches and MoE layers, is the
    number one rank logs: tp peers not counted twice, stages filling their own layers, a
    zero-bubble schedule's recomputed forwards not counted."""
    run_training(_config(tmp_path / "split", layout, preset("moe-tiny"), global_batch=8, steps=2, **options))
    one, split = one_rank_aux_losses, _aux_losses(tmp_path / "split")
    assert len(one) == len(split) == 2
    for step, (value, expected) in enumerate(zip(split, one)):
        assert math.isclose(value, expected, rel_tol=1e-5), (step, value, expected)


# Under -m slow (decision 208): test_six_experts_on_three_ranks_move_bit_exact loads fsdp3(ep3)'s 6
# experts into fsdp6(ep6) bit for bit, and test_moe_checkpoints' test_resumed_on_ep4_the_losses_continue
# resumes an MoE run on another ep and follows the uninterrupted losses.
@pytest.mark.slow
def test_async_saved_on_three_ranks_resumed_on_six_with_the_state_verified(run_training, rank_pool, tmp_path):
    """6 experts saved asynchronously on fsdp3(ep3), resumed on fsdp6(ep6), one expert a rank;
    verify_resume saves the loaded state again and checks its
    digests equal the checkpoint's before training on, and the resumed step is the uninterrupted one."""
    model = preset("moe-tiny", n_experts=6)
    full = run_training(_config(tmp_path, ParallelLayout(fsdp=3, ep=3), model, steps=3, run="full"))
    from rayshard.cluster.run.train import train

    train(_config(tmp_path, ParallelLayout(fsdp=3, ep=3), model, steps=2, run="cut", async_save=True), rank_pool)
    resumed = run_training(_config(tmp_path, ParallelLayout(fsdp=6, ep=6), model, steps=3, run="cut", resume="latest",
                                   verify_resume=True))
    assert resumed.start_step == 2 and sorted(resumed.losses) == [3]
    assert math.isclose(resumed.losses[3], full.losses[3], rel_tol=1e-5), (resumed.losses[3], full.losses[3])
    assert resumed.expert_tokens[3] == full.expert_tokens[3]
