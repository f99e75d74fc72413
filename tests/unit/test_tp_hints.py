"""A tp refusal's fix lists only degrees that meet every constraint at once (kv heads, hidden units,
experts', the vocabulary, a world size, the sequence under --sp): following it never runs into the
next check. And `--vocab-size N` sets the model's vocabulary (config `model.vocab_size`)."""
from __future__ import annotations

import ast
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


def test_vocab_1001_on_tp2_lists_only_degrees_every_size_allows():
    refused = _refusal(ModelChoice.named("tiny", vocab_size=1001), layout=ParallelLayout(tp=2))
    assert str(refused) == ("layout.tp=2: must divide model.vocab_size (1001) for the vocab-parallel embedding. "
                            "Fix: use --tp in [1], or a --vocab-size that tp divides")  # not 7, 11, 13: 2 kv heads


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
    with pytest.raises(ConfigError, match=r"tp=2: must divide model.vocab_size \(1001\) for the vocab-parallel embedding. "
                                          r"Fix: use tp in \[1\]$"):  # an offline reshard cannot change the vocabulary
        check_layout_fits(preset("tiny", vocab_size=1001), ParallelLayout(tp=2))


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
    assert main(["train", "--store", str(tmp_path / "s"), "--vocab-size", "1001", "--dp", "1", "--tp", "2"]) == 2
    assert "layout.tp=2: must divide model.vocab_size (1001)" in capsys.readouterr().err
    assert main(["train", "--store", str(tmp_path / "s"), "--model-factory", "examples.gpt2.model:tiny_gpt2",
                 "--vocab-size", "300"]) == 2
    assert "model.vocab_size=300: sets a built-in model's vocabulary" in capsys.readouterr().err
    write_checkpoint(str(tmp_path / "s"), "old", preset("tiny"), steps=1)
    assert Store(str(tmp_path / "s")).committed_steps("old") == [1]
    assert main(["train", "--store", str(tmp_path / "s"), "--run", "old", "--resume", "latest", "--vocab-size", "512"]) == 2
    assert "model.vocab_size=512: differs from the checkpoint's model (256)" in capsys.readouterr().err
