"""A user's own model (`examples/gpt2`, brought through `--model-factory`) passes the reference
model's checks: the same losses on one rank, dp2 x tp2 and pp2; a save resumed on another layout
continues the uninterrupted losses; a reshard there and back is bit-exact.

The bigger matrix (fsdp, pp x tp, interleaved stages, the reverse resume) runs under -m slow."""
from __future__ import annotations

import math
import sys

import pytest
import yaml

from rayshard.actors.model.user_model import describe_factory
from rayshard.cluster.cli.commands.train import config_from_args
from rayshard.cluster.cli.main import build_parser
from rayshard.cluster.catalog.store import Store
from rayshard.plans.config import ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.integration.reshard_helpers import chunk_fingerprint, digests, load_and_save

FACTORY = "examples.gpt2.model:tiny_gpt2"
STEPS = 6


def _config(tmp_path, layout, **overrides):
    return small_config(tmp_path, layout, model=ModelChoice(FACTORY, describe_factory(FACTORY)), steps=STEPS, **overrides)


def _assert_same_losses(losses, reference, steps=None):
    for step in steps or reference:
        assert math.isclose(losses[step], reference[step], rel_tol=1e-5), (step, losses[step], reference[step])


@pytest.fixture(scope="module")
def one_rank(run_training, tmp_path_factory):
    return run_training(_config(tmp_path_factory.mktemp("one"), ParallelLayout(), run="one"))


@pytest.fixture(scope="module")
def dp2_tp2(run_training, tmp_path_factory):
    root = tmp_path_factory.mktemp("dp2tp2")
    return root, run_training(_config(root, ParallelLayout(dp=2, tp=2), run="src", ckpt_every=3))


@pytest.mark.slow  # decision 200: the pp2 case checks one-rank losses; the dp2 x tp2 run is resumed below
def test_the_example_trains_on_dp2_tp2_with_the_one_rank_losses(one_rank, dp2_tp2):
    _, result = dp2_tp2
    assert sorted(result.losses) == list(range(1, STEPS + 1))
    assert one_rank.losses[STEPS] < one_rank.losses[1]  # it trains
    _assert_same_losses(result.losses, one_rank.losses)


def test_the_example_trains_on_pp2_with_the_one_rank_losses(run_training, one_rank, tmp_path):
    result = run_training(_config(tmp_path, ParallelLayout(pp=2), run="pp2", microbatches=2))
    _assert_same_losses(result.losses, one_rank.losses)


def test_a_dp2_tp2_save_resumes_on_pp2_through_the_cli_and_continues_the_losses(run_training, dp2_tp2):
    """The resume names no model: it rebuilds the checkpoint's (the recorded factory and shapes)."""
    root, whole = dp2_tp2
    settings = _config(root, ParallelLayout(pp=2), run="piped", microbatches=2, resume="src@3").to_dict()
    settings.pop("model")  # a config file of the same run without its model
    path = root / "piped.yaml"
    path.write_text(yaml.safe_dump(settings))
    config = config_from_args(build_parser().parse_args(["train", "--config", str(path)]))
    assert config.model.spec == describe_factory(FACTORY)
    piped = run_training(config)
    assert sorted(piped.losses) == [4, 5, 6]
    _assert_same_losses(piped.losses, whole.losses, [4, 5, 6])


def test_a_reshard_to_pp2_and_back_through_training_actors_is_bit_exact(rank_pool, dp2_tp2, tmp_path):
    root, whole = dp2_tp2
    source = Store(str(root / "store")).resolve("src@3").url
    there = load_and_save(_config(root, ParallelLayout(pp=2), run="there"), source, rank_pool)
    assert digests(there) == digests(source)
    back = load_and_save(_config(root, ParallelLayout(dp=2, tp=2), run="back"), there, rank_pool)
    assert chunk_fingerprint(back) == chunk_fingerprint(source)


# fsdp4 under -m slow (decision 208): pp2_tp2 reads the recorded shapes, tp splits and stage parts.
@pytest.mark.parametrize("layout", [ParallelLayout(pp=2, tp=2), pytest.param(ParallelLayout(fsdp=4), marks=pytest.mark.slow)],
                         ids=["pp2_tp2", "fsdp4"])
def test_an_offline_reshard_there_and_back_is_bit_exact_without_the_users_code(dp2_tp2, layout, monkeypatch):
    """The offline planner reads shapes, tp splits and stage parts from the checkpoint's record:
    the factory's module is made unimportable and the round trip still holds."""
    from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint

    root, _ = dp2_tp2
    store = Store(str(root / "store"))
    source = store.resolve("src@3").url
    monkeypatch.setitem(sys.modules, "examples.gpt2.model", None)  # import now raises ImportError
    name = "x".join(f"{k}{v}" for k, v in layout.to_dict().items() if v > 1)
    there = reshard_checkpoint(source, layout, store, f"off-{name}", local=True, log=lambda *_: None).url
    assert digests(there) == digests(source)
    back = reshard_checkpoint(there, ParallelLayout(dp=2, tp=2), store, f"back-{name}", local=True,
                              log=lambda *_: None).url
    assert chunk_fingerprint(back) == chunk_fingerprint(source)

def test_the_factorys_own_criterion_is_the_loss_under_tp(run_training, one_rank, tmp_path):
    """The criterion is kept apart from the model: the example's doubled cross-entropy, run on
    vocab-sharded logits under tp, reports twice the built-in loss before any update."""
    model = describe_factory("examples.gpt2.model:tiny_gpt2_doubled_loss")
    assert model.user.plan.loss == "examples.gpt2.model:doubled_cross_entropy"
    result = run_training(small_config(tmp_path, ParallelLayout(tp=2), model=ModelChoice(spec=model), steps=1,
                                       run="doubled"))
    assert math.isclose(result.losses[1], 2 * one_rank.losses[1], rel_tol=1e-5)


@pytest.mark.slow  # decision 113: the default suite's 15 minutes
def test_a_plans_sequence_parallel_matches_tp_without_it_eager_and_compiled(run_training, tmp_path):
    """The plan's --sp additions (LayerNorms on sequence shards, gathers before the blocks'
    halves) with the tp styles' sequence-sharded forms derived: the tp2 losses within 1e-5, and
    so with each block compiled. (The model hands the embedding's output straight to the first
    block: under TP a view of a DTensor's local tensor, which a compiled block's backward
    could not take until the embedding's style copied it.)"""
    model = ModelChoice(spec=describe_factory("examples.gpt2.model:tiny_gpt2_without_positions"))
    plain = run_training(small_config(tmp_path, ParallelLayout(tp=2), model=model, steps=STEPS, run="tp"))
    sp = run_training(small_config(tmp_path, ParallelLayout(tp=2), model=model, steps=STEPS, run="sp",
                                   sequence_parallel=True))
    _assert_same_losses(sp.losses, plain.losses)
    compiled = run_training(small_config(tmp_path, ParallelLayout(tp=2), model=model, steps=3, run="sp-compiled",
                                         sequence_parallel=True, compile=True))
    _assert_same_losses(compiled.losses, plain.losses, steps=[1, 2, 3])

SLOW_LAYOUTS = {"fsdp2": ParallelLayout(fsdp=2), "dp2_fsdp2": ParallelLayout(dp=2, fsdp=2),
                "pp2_tp2": ParallelLayout(pp=2, tp=2), "pp2_vpp2": ParallelLayout(pp=2, vpp=2),
                "fsdp2_tp2": ParallelLayout(fsdp=2, tp=2), "pp4": ParallelLayout(pp=4)}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_LAYOUTS))
def test_the_example_trains_with_the_one_rank_losses_on_more_layouts(run_training, one_rank, tmp_path, name):
    layout = SLOW_LAYOUTS[name]
    result = run_training(_config(tmp_path, layout, run=name, microbatches=2 if layout.pp > 1 else 1,
                                  schedule="interleaved1f1b" if layout.vpp > 1 else "1f1b"))
    _assert_same_losses(result.losses, one_rank.losses)


@pytest.mark.slow
def test_a_pp2_save_resumes_on_fsdp2_tp2_and_continues_the_losses(run_training, tmp_path):
    whole = run_training(_config(tmp_path, ParallelLayout(pp=2), run="pp", microbatches=2, ckpt_every=3))
    resumed = run_training(_config(tmp_path, ParallelLayout(fsdp=2, tp=2), run="fsdp", resume="pp@3"))
    assert sorted(resumed.losses) == [4, 5, 6]
    _assert_same_losses(resumed.losses, whole.losses, [4, 5, 6])
