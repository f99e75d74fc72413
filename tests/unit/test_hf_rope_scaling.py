"""RoPE scaling as transformers computes it: a random Llama (and Qwen2.5's yarn) of odd size with
each scaling type imports, computes transformers' logits and loss within 1e-6 relative on a
sequence longer than the context it claims to have been trained on, and exports back
bit-identical with its scaling in config.json.

Sizes: 3 layers, hidden 96, 6 heads over 2 kv heads (head size 16), vocabulary 1001, perturbed
norms. original_max_position_embeddings is 16 and the sequence 40, so every scaled frequency
matters; dynamic (which reads max_position_embeddings itself) gets max_position_embeddings 16.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from rayshard.actors.model.rope import rope_tables
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.plans.training.rope_scaling import RopeScaling
from tests.unit.test_hf_families import ours_from

SIZES = dict(vocab_size=1001, hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, rms_norm_eps=1e-6)
ORIGINAL, SEQ = 16, 40
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    # DeepSeek's form: attention factor from mscale / mscale_all_dim, an untruncated ramp.
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "beta_fast": 24.0, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
}


def _perturbed(model):
    with torch.no_grad():  # transformers starts norms at 1: make every tensor tell
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model.eval()


def hf_llama(scaling: dict, seed: int = 5, **extra):
    max_positions = ORIGINAL if scaling["rope_type"] == "dynamic" else 64
    config = transformers.LlamaConfig(**{**SIZES, **extra}, max_position_embeddings=max_positions,
                                      rope_parameters={**scaling, "rope_theta": 500.0})
    torch.manual_seed(seed)
    return _perturbed(transformers.LlamaForCausalLM(config))


def _tokens(vocab_size: int) -> torch.Tensor:
    # Asymmetric: two different random rows, no repeated pattern a position error could hide in.
    return torch.randint(0, vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(9))


def _assert_computes_transformers(ours, reference, vocab_size):
    tokens = _tokens(vocab_size)
    with torch.no_grad():
        theirs = reference(tokens, labels=tokens)
        logits = ours(tokens)
    scale = theirs.logits.abs().max().item()
    assert (logits - theirs.logits).abs().max().item() <= 1e-6 * scale, (logits - theirs.logits).abs().max().item()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab_size), tokens[:, 1:].reshape(-1)).item()
    assert abs(loss - theirs.loss.item()) <= 1e-6 * theirs.loss.item(), (loss, theirs.loss.item())


@pytest.mark.parametrize("name", list(SCALINGS))
def test_a_scaled_llama_imports_computes_transformers_and_exports_bit_identical(tmp_path, name):
    reference = hf_llama(SCALINGS[name])
    reference.save_pretrained(str(tmp_path / "hf"))
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda *_: None)
    config, ours = ours_from(url)
    assert config.rope_scaling.rope_type == SCALINGS[name]["rope_type"]
    _assert_computes_transformers(ours, reference, SIZES["vocab_size"])

    export_hf(url, str(tmp_path / "again"), include_optimizer=False, log=lambda *_: None)
    again, original = load_file(str(tmp_path / "again" / "model.safetensors")), reference.state_dict()
    assert set(again) == set(original)
    for tensor, value in original.items():
        assert torch.equal(again[tensor], value), tensor
    exported = json.loads((tmp_path / "again" / "config.json").read_text())
    assert exported["rope_parameters"] == {**SCALINGS[name], "rope_theta": 500.0}
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "again"), dtype=torch.float32).eval()
    tokens = _tokens(SIZES["vocab_size"])
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, reference(tokens).logits)
    # and the export imports back as the same model
    again_url = import_hf(str(tmp_path / "again"), Store(str(tmp_path / "store")), "again", log=lambda *_: None)
    assert ours_from(again_url)[0] == config


def test_a_qwen25_yarn_config_in_the_4x_spelling_imports_and_computes_transformers(tmp_path):
    """Qwen2.5's long-context setting as its config.json has it: `rope_scaling` with `type`."""
    config = transformers.Qwen2Config(**SIZES, max_position_embeddings=64, rope_theta=1000.0,
                                      rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL})
    torch.manual_seed(6)
    reference = _perturbed(transformers.Qwen2ForCausalLM(config))
    reference.save_pretrained(str(tmp_path / "hf"))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    settings.pop("rope_parameters", None)  # as the Hub's file: rope_theta and rope_scaling only
    settings.update(rope_theta=1000.0, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL})
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "qwen", log=lambda *_: None)
    imported, ours = ours_from(url)
    assert (imported.family, imported.rope_theta, imported.rope_scaling.rope_type) == ("qwen2", 1000.0, "yarn")
    _assert_computes_transformers(ours, reference, SIZES["vocab_size"])


def test_dynamic_tables_follow_the_sequence_length_as_transformers_does_per_forward():
    """Within max_position_embeddings dynamic is plain RoPE; past it the base grows with the length."""
    scaling = RopeScaling("dynamic", factor=2.0)
    plain = rope_tables(12, 16, 500.0)
    assert all(torch.equal(a, b) for a, b in zip(rope_tables(12, 16, 500.0, scaling=scaling, max_seq_len=16), plain))
    longer = rope_tables(40, 16, 500.0, scaling=scaling, max_seq_len=16)
    assert not torch.allclose(longer[0][:12], plain[0], atol=1e-4)
    config = transformers.LlamaConfig(**SIZES, max_position_embeddings=16,
                                      rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500.0})
    embedding = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    cos, sin = embedding(torch.zeros(1, 40, 16), torch.arange(40)[None])
    torch.testing.assert_close(longer[0], cos[0], rtol=0, atol=3e-6)
    torch.testing.assert_close(longer[1], sin[0], rtol=0, atol=3e-6)


@pytest.mark.parametrize("scaling, named", [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 16}, "high_freq_factor=1.0: must exceed low_freq_factor"),
    ({"rope_type": "linear", "factor": -2.0}, "factor=-2.0: must be positive"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
])
def test_a_scaling_rayshard_cannot_compute_is_refused_in_one_line(tmp_path, scaling, named):
    hf_llama(SCALINGS["linear"]).save_pretrained(str(tmp_path / "hf"))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    settings["rope_parameters"] = {**scaling, "rope_theta": 500.0}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=named.replace("(", r"\(").replace("[", r"\[")) as raised:
        import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "refused", log=lambda *_: None)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("scaling, named", [
    ({"rope_type": "ntk"}, "rope_type='ntk': is not one of"),
    ({"rope_type": "llama3", "factor": 8.0}, "original_max_position_embeddings=None: is required by rope_type 'llama3'"),
    ({"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}, "low_freq_factor=1.0: is not read by rope_type 'linear'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, "original_max_position_embeddings=0"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, "stretches nothing"),
    ({"rope_type": "linear", "factr": 2.0}, "unknown key"),
])
def test_a_config_files_rope_scaling_is_validated_naming_the_field(scaling, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        ModelConfig(max_seq_len=64, rope_scaling=scaling).validate()


def test_the_scaling_travels_through_metadata():
    model = ModelConfig(max_seq_len=64, rope_scaling=SCALINGS["llama3"]).validate()
    assert ModelConfig.from_dict(json.loads(json.dumps(model.to_dict()))) == model


def test_a_dynamic_model_trains_past_its_original_context_up_to_factor_times_it():
    """Dynamic NTK scaling's max_position_embeddings is the original context, and the point of it
    is running past that: training may go up to factor times it, and no further (one line)."""
    from rayshard.plans.config import ModelChoice, TrainConfig
    from rayshard.plans.training.model_spec import preset

    spec = preset("tiny", max_seq_len=16, rope_scaling=RopeScaling("dynamic", factor=3.0))
    assert TrainConfig(model=ModelChoice(spec=spec), seq_len=48, global_batch=4).validate().seq_len == 48
    with pytest.raises(ConfigError, match=r"exceeds model.max_seq_len \(16, times its dynamic RoPE factor \(3\)\)"):
        TrainConfig(model=ModelChoice(spec=spec), seq_len=49, global_batch=4).validate()
    plain = preset("tiny", max_seq_len=16)
    with pytest.raises(ConfigError, match=r"exceeds model.max_seq_len \(16\)\. Fix: set --seq-len 16 or less"):
        TrainConfig(model=ModelChoice(spec=plain), seq_len=17, global_batch=4).validate()
