"""A tp refusal's fix lists only degrees that meet every constraint at once (kv heads, hidden units,
experts', a world size, the sequence under --sp): following it never runs into the next check.
The vocabulary is no constraint: any vocabulary fits any tp (decision 118). And `--vocab-size N`
sets the model's vocabulary (config `model.vocab_size`)."""
from __future__ import annotations

import ast
import dataclasses
import re

import pytest

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.cli.commands.train import config_from_args
from rayshard.cluster.cli.main import build_parser, main
from rayshard.plans.checkpoint.regions import check_layout_fits
from rayshard.plans.config import ModelChoice, NumericsConfig, ResourcesConfig, TrainConfig
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.layout.chooser import _tp_candidates
from rayshard.plans.training.model_spec import preset
from tests.unit.checkpoint_factory import write_checkpoint

# 14 kv heads, ffn 77 = 7*11, vocabulary 1001 = 7*11*13: 7 divides all three, 2, 11 and 13 some.
ODD = dict(vocab_size=1001, dim=112, n_heads=14, n_kv_heads=14, ffn_dim=77)


def _refusal(model: ModelChoice, **config) -> ConfigError:
    with pytest.raises(ConfigError) as refused:
        TrainConfig(model=model, **config).validate()
    return refused.value


def _listed(error: ConfigError) -> list[int]:
    return ast.literal_eval(re.search(r"in (\[[0-9, ]+\])", error.fix).group(1))


@pytest.mark.parametrize("vocab", [1001, 50257])
def test_any_vocabulary_fits_every_tp_the_other_sizes_allow(vocab):
    """tiny: 2 kv heads, ffn 160. tp 2 splits 1001 and GPT-2's 50257 (29 * 1733) unevenly, and the
    fix of a refused tp lists what the kv heads and ffn allow, not the vocabulary's divisors."""
    model = ModelChoice.named("tiny", vocab_size=vocab)
    TrainConfig(model=model, layout=ParallelLayout(tp=2)).validate()
    check_layout_fits(model.spec, ParallelLayout(tp=2))  # the offline reshard's check too
    assert _tp_candidates(model.spec, ranks_per_node=8) == [1, 2]
    refused = _refusal(model, layout=ParallelLayout(tp=4))
    assert str(refused) == "layout.tp=4: must divide the number of kv heads (2). Fix: use --tp in [1, 2]"
    wide = ModelChoice.named("tiny", vocab_size=vocab, dim=48, n_heads=12, n_kv_heads=12, ffn_dim=96)
    for tp in (3, 4, 6, 12):
        TrainConfig(model=wide, layout=ParallelLayout(tp=tp), global_batch=8, seq_len=24).validate()
    assert _listed(_refusal(wide, layout=ParallelLayout(tp=5))) == [1, 2, 3, 4, 6, 12]


def test_a_user_plans_vocab_parallel_modules_need_not_divide_but_its_other_splits_must():
    from rayshard.actors.model.user_model import describe_factory

    model = describe_factory("examples.gpt2.model:tiny_gpt2")  # heads of 16, vocabulary 256, dim 64
    odd = dataclasses.replace(model, user=dataclasses.replace(model.user, parameters=tuple(
        (name, (1001, *shape[1:]) if name in ("wte.weight", "lm_head.weight") else shape, split)
        for name, shape, split in model.user.parameters)))
    TrainConfig(model=ModelChoice(spec=odd), layout=ParallelLayout(tp=4), global_batch=8, seq_len=32).validate()
    refused = _refusal(ModelChoice(spec=odd), layout=ParallelLayout(tp=3), global_batch=8, seq_len=32)
    assert str(refused).startswith("layout.tp=3: cannot split parameter blocks.0.attn.q.weight of shape [64, 64] "
                                   "along dim 0. Fix: use --tp in [1, 2, 4, 8, 16, 32, 64]")


@pytest.mark.parametrize("tp, first", [(2, "model.ffn_dim (77)"), (11, "the number of kv heads (14)"),
                                       (14, "model.ffn_dim (77)"), (13, "the number of kv heads (14)")])
def test_every_listed_degree_passes_every_check(tp, first):
    model = ModelChoice.named("tiny", **ODD)
    refused = _refusal(model, layout=ParallelLayout(tp=tp), global_batch=8, seq_len=28)
    assert first in refused.constraint and _listed(refused) == [1, 7]
    for fitting in _listed(refused):
        TrainConfig(model=model, layout=ParallelLayout(tp=fitting), global_batch=8, seq_len=28).validate()


def test_the_runs_world_size_and_sequence_narrow_the_list():
    model = ModelChoice.named("tiny", **ODD)
    assert _listed(_refusal(model, layout=ParallelLayout(tp=2), resources=ResourcesConfig(world_size=2))) == [1]
    assert _listed(_refusal(model, layout=ParallelLayout(tp=2), numerics=NumericsConfig(sequence_parallel=True),
                            seq_len=30)) == [1]  # 7 does not divide 30 tokens under --sp
    assert _listed(_refusal(model, layout=ParallelLayout(tp=2), numerics=NumericsConfig(sequence_parallel=True),
                            seq_len=28)) == [1, 7]


def test_experts_offline_fits_and_the_chooser_use_the_same_list():
    moe = preset("moe-tiny", n_kv_heads=4, expert_ffn_dim=34)  # 4 kv heads, ffn 160, vocab 256, shared expert 64
    with pytest.raises(ConfigError) as refused:
        check_layout_fits(moe, ParallelLayout(tp=4))
    assert str(refused.value) == "tp=4: must divide model.expert_ffn_dim (34). Fix: use tp in [1, 2]"
    odd = preset("tiny", **ODD)
    assert _tp_candidates(odd, ranks_per_node=8) == [1, 7]
    with pytest.raises(ConfigError, match=r"tp=2: must divide model.ffn_dim \(77\). Fix: use tp in \[1, 7\]$"):
        check_layout_fits(odd, ParallelLayout(tp=2))


def _args(tmp_path, *flags):
    return build_parser().parse_args(["train", "--store", str(tmp_path / "store"), *flags])


def test_vocab_size_flag_sets_the_models_vocabulary(tmp_path):
    config = config_from_args(_args(tmp_path, "--vocab-size", "1000", "--dp", "1", "--tp", "2"))
    assert config.model.spec.vocab_size == 1000 and config.model.preset == "tiny"
    (tmp_path / "c.yaml").write_text("model: {preset: tiny, vocab_size: 502}\nlayout: {dp: 1, tp: 2}\n")
    assert config_from_args(_args(tmp_path, "--config", str(tmp_path / "c.yaml"))).model.spec.vocab_size == 502
    flagged = config_from_args(_args(tmp_path, "--config", str(tmp_path / "c.yaml"), "--vocab-size", "600"))
    assert flagged.model.spec.vocab_size == 600  # the flag over the file, as every flag


def test_vocab_size_is_refused_where_it_cannot_apply(tmp_path, capsys):
    assert main(["train", "--store", str(tmp_path / "s"), "--vocab-size", "1001", "--dp", "1", "--tp", "4"]) == 2
    assert "layout.tp=4: must divide the number of kv heads (2)" in capsys.readouterr().err
    assert main(["train", "--store", str(tmp_path / "s"), "--model-factory", "examples.gpt2.model:tiny_gpt2",
                 "--vocab-size", "300"]) == 2
    assert "model.vocab_size=300: sets a built-in model's vocabulary" in capsys.readouterr().err
    write_checkpoint(str(tmp_path / "s"), "old", preset("tiny"), steps=1)
    assert Store(str(tmp_path / "s")).committed_steps("old") == [1]
    assert main(["train", "--store", str(tmp_path / "s"), "--run", "old", "--resume", "latest", "--vocab-size", "512"]) == 2
    assert "model.vocab_size=512: differs from the checkpoint's model (256)" in capsys.readouterr().err
