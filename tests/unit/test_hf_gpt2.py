"""GPT-2 (`GPT2LMHeadModel`) from a plain transformers directory: the built-in decoder with its
switches (learned positions, LayerNorm with bias, tanh GELU MLP, biases everywhere, tied head).

A random GPT-2 of odd size (3 layers, n_embd 96, 6 heads of 16, n_positions 64, vocabulary 250,
every bias and norm perturbed so that each tensor tells) imports, computes transformers' logits
(fp32, 1e-5) and loss (1e-6 relative), and exports back bit-identical to what save_pretrained
wrote: Conv1D weights transposed back, q|k|v fused by columns again. A config rayshard would
compute otherwise is refused in one line naming the field.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from rayshard.actors.model.transformer import Transformer
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.plans.interop.hf_families import hf_mapping
from rayshard.plans.training.model_spec import ModelConfig, parameter_shapes, preset
from tests.unit.test_hf_families import ours_from

SIZES = dict(vocab_size=250, n_embd=96, n_layer=3, n_head=6, n_positions=64)
SEQ = 40


def gpt2_model(tied: bool = True, seed: int = 5, **changes) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**SIZES, tie_word_embeddings=tied, **changes))
    with torch.no_grad():  # transformers starts biases and norms at 0 and 1: make every tensor tell
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model.eval()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_gpt2_directory_imports_computes_transformers_loss_and_exports_bit_identical(tmp_path, tied):
    reference = gpt2_model(tied)
    reference.save_pretrained(str(tmp_path / "hf"))
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda *_: None)
    config, ours = ours_from(url)
    assert (config.family, config.position_embedding, config.norm, config.mlp, config.tie_embeddings) == (
        "gpt2", "learned", "layernorm", "gelu_tanh", tied)
    tokens = torch.randint(0, SIZES["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, theirs = ours(tokens), reference(tokens, labels=tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert (logits - theirs.logits).abs().max().item() <= 1e-5
    assert abs(loss.item() - theirs.loss.item()) <= 1e-6 * theirs.loss.item(), (loss.item(), theirs.loss.item())

    export_hf(url, str(tmp_path / "again"), include_optimizer=False, log=lambda *_: None)
    again, original = load_file(str(tmp_path / "again" / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(again) == set(original)  # tied: no lm_head.weight on either side
    for name, value in original.items():
        assert torch.equal(again[name], value), name
    exported = json.loads((tmp_path / "again" / "config.json").read_text())
    assert (exported["model_type"], exported["architectures"], exported["activation_function"]) == (
        "gpt2", ["GPT2LMHeadModel"], "gelu_new")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "again"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, theirs.logits)


def test_exact_gelu_imports_as_its_own_switch_and_exports_back(tmp_path):
    reference = gpt2_model(activation_function="gelu")
    reference.save_pretrained(str(tmp_path / "hf"))
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda *_: None)
    config, ours = ours_from(url)
    assert config.mlp == "gelu"
    tokens = torch.randint(0, SIZES["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(tokens) - reference(tokens).logits).abs().max().item() <= 1e-5
    export_hf(url, str(tmp_path / "again"), include_optimizer=False, log=lambda *_: None)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["activation_function"] == "gelu"


@pytest.mark.parametrize("change, field", [
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=True"),
    ({"scale_attn_weights": False}, "scale_attn_weights=False"),
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"add_cross_attention": True}, "add_cross_attention=True"),
    ({"n_embd": None}, "has no n_embd"),
    ({"layer_norm_epsilon": "small"}, "layer_norm_epsilon='small'"),
])
def test_a_gpt2_config_rayshard_would_compute_otherwise_is_refused_naming_the_field(tmp_path, change, field):
    gpt2_model().save_pretrained(str(tmp_path / "hf"))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    settings.update(change)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=field) as refused:
        import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "refused", log=lambda *_: None)
    assert "\n" not in str(refused.value)


def test_the_switches_build_exactly_the_parameters_the_plan_names():
    config = ModelConfig(vocab_size=250, dim=96, n_layers=3, n_heads=6, n_kv_heads=6, ffn_dim=384, max_seq_len=64,
                         family="gpt2", position_embedding="learned", norm="layernorm", mlp="gelu_tanh", qkv_bias=True,
                         wo_bias=True, mlp_bias=True, tie_embeddings=True).validate()
    built = {name: tuple(param.shape) for name, param in Transformer(config).named_parameters()}
    assert list(built.items()) == list(parameter_shapes(config).items())
    assert {"pos_embeddings.weight", "layers.0.attention.wo.bias", "layers.2.feed_forward.up.bias", "norm.bias"} <= set(built)


@pytest.mark.parametrize("changes, field", [
    ({"mlp": "relu"}, "model.mlp"),
    ({"norm": "batchnorm"}, "model.norm"),
    ({"position_embedding": "alibi"}, "model.position_embedding"),
    ({"mlp_bias": True}, "model.mlp_bias"),  # the fused SwiGLU has no bias
])
def test_a_switch_out_of_range_is_refused_naming_it(changes, field):
    with pytest.raises(ConfigError, match=field):
        preset("tiny", **changes)


def test_a_llama_with_gpt2_switches_is_not_exported_as_llama():
    model = preset("tiny", norm="layernorm", wo_bias=True)
    with pytest.raises(CheckpointError, match="model.norm='layernorm', wo_bias=True is not what LlamaForCausalLM computes"):
        hf_mapping(model)
    with pytest.raises(CheckpointError, match="model.n_kv_heads=2 is not what GPT2LMHeadModel computes"):
        hf_mapping(preset("tiny", family="gpt2", position_embedding="learned", norm="layernorm", mlp="gelu_tanh",
                          qkv_bias=True, wo_bias=True, mlp_bias=True))


def test_a_hub_gpt2_file_without_the_transformer_prefix_and_with_mask_buffers_imports(tmp_path):
    """openai-community/gpt2's model.safetensors was saved from the base model (`wte.weight`,
    `h.0.attn.c_attn.weight`) with each layer's causal mask `h.N.attn.bias` as a tensor."""
    from safetensors.torch import save_file

    reference = gpt2_model(tied=True)
    reference.save_pretrained(str(tmp_path / "hf"))
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))
    hub = {name.removeprefix("transformer."): value for name, value in written.items()}
    mask = torch.tril(torch.ones(SIZES["n_positions"], SIZES["n_positions"])).view(1, 1, SIZES["n_positions"], -1)
    hub.update({f"h.{layer}.attn.bias": mask.clone() for layer in range(SIZES["n_layer"])})
    save_file(hub, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})

    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda *_: None)
    _, ours = ours_from(url)
    tokens = torch.randint(0, SIZES["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (ours(tokens) - reference(tokens).logits).abs().max().item() <= 1e-5
    export_hf(url, str(tmp_path / "again"), include_optimizer=False, log=lambda *_: None)
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(again) == set(written) and all(torch.equal(again[name], written[name]) for name in written)
