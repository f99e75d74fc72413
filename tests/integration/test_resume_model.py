"""A resume builds the checkpoint's own model unless the user names one.

As a new user would: import a Hugging Face Llama whose sizes are no preset's, then
`rayshard train --resume latest` with nothing else said about the model.
"""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from rayshard.cluster.checkpoint.hf_interop import import_hf
from rayshard.cluster.cli.commands.train import config_from_args
from rayshard.cluster.cli.main import build_parser
from rayshard.cluster.catalog.store import Store
from rayshard.plans.errors import ConfigError
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.plans.training.special_tokens import SpecialTokens

# Sizes no preset has: 3 layers, 6 heads over 2 kv heads, head_dim 8, vocab 264.
HF_SIZES = dict(vocab_size=264, hidden_size=48, intermediate_size=112, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=128)
IMPORTED = ModelConfig(vocab_size=264, dim=48, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=112, max_seq_len=128,
                       norm_eps=1e-6,  # LlamaConfig's default rms_norm_eps
                       special_tokens=SpecialTokens(bos_token_id=1, eos_token_id=2))  # and its default ids


@pytest.fixture
def imported_store(tmp_path):
    torch.manual_seed(5)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_SIZES)).save_pretrained(str(tmp_path / "hf"))
    store = str(tmp_path / "store")
    import_hf(str(tmp_path / "hf"), Store(store), "imported", log=lambda *_: None)
    return store


def _args(store: str, *flags: str):
    return build_parser().parse_args(["train", "--store", store, "--run", "imported", "--dp", "1", "--tp", "1",
                                      "--global-batch", "4", "--seq-len", "32", "--steps", "2", *flags])


def test_resume_latest_builds_the_imported_model_and_trains(run_training, imported_store):
    config = config_from_args(_args(imported_store, "--resume", "latest"))
    assert config.model.spec == IMPORTED
    result = run_training(config)
    assert sorted(result.losses) == [1, 2]
    assert all(math.isfinite(loss) for loss in result.losses.values())
    # A random model over 264 tokens starts near log(264).
    assert abs(result.losses[1] - math.log(264)) < 0.5


def test_a_named_model_that_differs_lists_the_fields(imported_store):
    with pytest.raises(ConfigError, match=r"model='tiny': differs from the checkpoint's model in vocab_size \(264 -> 256\), "
                                          r"dim \(48 -> 64\), n_layers \(3 -> 4\), n_heads \(6 -> 4\)"):
        config_from_args(_args(imported_store, "--resume", "latest", "--model", "tiny"))


def test_a_config_file_naming_only_model_preset_is_a_named_model(imported_store, tmp_path):
    # A top-level `model_preset:` is a choice as much as a model section: refused, not replaced.
    (tmp_path / "mine.yaml").write_text("model_preset: tiny\n")
    with pytest.raises(ConfigError, match=r"model='tiny': differs from the checkpoint's model in vocab_size"):
        config_from_args(_args(imported_store, "--resume", "latest", "--config", str(tmp_path / "mine.yaml")))


def test_auto_on_a_fresh_run_keeps_the_configured_model(tmp_path):
    config = config_from_args(_args(str(tmp_path / "empty"), "--resume", "auto"))
    assert config.model.preset == "tiny" and config.model.spec.dim == 64
