"""Mixture-of-experts Hugging Face interop without Ray: a checkpoint of our MoE model exports to
the Hub's per-expert layout that transformers loads and computes our logits from (fp32, 1e-5),
and imports back digest for digest; a transformers-made model imports, computes its logits in our
model, and exports back bit-identical to its own save_pretrained. An export whose experts were
dropped or renumbered, and settings transformers would compute otherwise, are refused in one line.

Data is asymmetric where it matters: every expert holds different weights (a trained checkpoint,
or random ones), so swapped experts, swapped gate/up halves or a transposed down projection
change the logits far beyond 1e-5."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rayshard.cluster.checkpoint.digest import digest_checkpoint
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.cluster.catalog.store import Store
from rayshard.plans.errors import CheckpointError
from rayshard.plans.training.model_spec import preset
from tests.unit.checkpoint_factory import write_checkpoint
from tests.unit.test_hf_families import ours_from

QWEN2_MOE = preset("moe-tiny")  # layers 1 and 3 MoE (8 experts, top-2), shared expert, q/k/v biases
# Every layer MoE, no shared expert, per-head q/k norms, a head size that is not dim / heads.
QWEN3_MOE = preset("moe-tiny", family="qwen3_moe", qkv_bias=False, qk_norm=True, shared_expert_ffn_dim=0, moe_every=1,
                   head_size=24, norm_topk=True)
MODELS = {"qwen2_moe": QWEN2_MOE, "qwen2_moe-norm_topk": replace(QWEN2_MOE, norm_topk=True), "qwen3_moe": QWEN3_MOE}
CLASSES = {"qwen2_moe": transformers.Qwen2MoeForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM}


def _tokens():
    return torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            store = str(tmp_path_factory.mktemp("moe-store") / "store")
            url, model, _ = write_checkpoint(store, "src", MODELS[name])
            cache[name] = (url, model.eval(), store)
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(MODELS))
def test_transformers_loads_the_per_expert_export_computes_our_logits_and_it_imports_back_bit_exact(written, tmp_path, name):
    url, model, store = written(name)
    config = MODELS[name]
    export_hf(url, str(tmp_path / "hf"), log=lambda *_: None)
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    layer = f"model.layers.{config.moe_layers[0]}.mlp."
    experts = {key for key in saved if key.startswith(layer + "experts.")}
    assert experts == {f"{layer}experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")}
    ffn, dim = config.expert_ffn_dim, config.dim
    assert saved[layer + "experts.5.gate_proj.weight"].shape == (ffn, dim) and saved[layer + "experts.5.down_proj.weight"].shape == (dim, ffn)
    stacked = model.layers[str(config.moe_layers[0])].feed_forward.experts
    # Expert 5's gate is its stacked rows 0, 2, 4, ... (gate_j, up_j interleaved), up the odd rows.
    assert torch.equal(saved[layer + "experts.5.gate_proj.weight"], stacked.gate_up.weight[5, 0::2].detach())
    assert torch.equal(saved[layer + "experts.5.up_proj.weight"], stacked.gate_up.weight[5, 1::2].detach())

    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["architectures"] == [CLASSES[config.family].__name__]
    assert (hf_config["num_experts"], hf_config["num_experts_per_tok"], hf_config["moe_intermediate_size"],
            hf_config["decoder_sparse_step"], hf_config["mlp_only_layers"], hf_config["norm_topk_prob"]) == \
        (8, 2, 32, config.moe_every, [], config.norm_topk)
    loaded = CLASSES[config.family].from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    with torch.no_grad():
        difference = (loaded(_tokens()).logits - model(_tokens())).abs().max().item()
    assert difference <= 1e-5, difference

    imported = import_hf(str(tmp_path / "hf"), Store(store), "imported", log=lambda *_: None)
    assert digest_checkpoint(imported) == digest_checkpoint(url)  # weights and both moments


def _hf_moe(family: str):
    """A random transformers model: 4 experts of 12 hidden units, top-2, layers 1 and 3 MoE."""
    common = dict(vocab_size=250, hidden_size=48, intermediate_size=88, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=12, decoder_sparse_step=2, norm_topk_prob=family == "qwen3_moe")
    if family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=20)
    else:
        config = transformers.Qwen3MoeConfig(**common, head_dim=16)
    torch.manual_seed(5)
    model = CLASSES[family](config)
    with torch.no_grad():  # transformers starts the router at 0, biases at 0 and norms at 1: make every tensor tell
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    return model.eval()


@pytest.mark.parametrize("family", list(CLASSES))
def test_a_transformers_moe_imports_computes_its_logits_and_exports_back_bit_identical(tmp_path, family):
    reference = _hf_moe(family)
    reference.save_pretrained(str(tmp_path / "hf"))
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda *_: None)
    config, ours = ours_from(url)
    assert (config.family, config.n_experts, config.moe_layers, config.shared_expert_ffn_dim) == \
        (family, 4, (1, 3), 20 if family == "qwen2_moe" else 0)
    tokens = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        difference = (ours(tokens) - reference(tokens).logits).abs().max().item()
    assert difference <= 1e-5, difference
    export_hf(url, str(tmp_path / "again"), include_optimizer=False, log=lambda *_: None)
    again, original = load_file(str(tmp_path / "again" / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(again) == set(original)  # save_pretrained's per-expert keys, one for one
    for name, value in original.items():
        assert torch.equal(again[name], value), name


def _edit_export(directory, edit):
    path = str(directory / "model.safetensors")
    tensors = load_file(path)
    save_file(edit(tensors), path, metadata={"format": "pt"})


def _without_expert(tensors, expert):
    return {name: value for name, value in tensors.items() if f".experts.{expert}." not in name}


def _renumbered(tensors, old, new):
    return {name.replace(f".experts.{old}.", f".experts.{new}."): value for name, value in tensors.items()}


@pytest.mark.parametrize("edit, says", [
    (lambda t: _without_expert(t, 3), "but missing model.layers.1.mlp.experts.3.down_proj.weight; Fix: "),
    (lambda t: _renumbered(t, 7, 9), "but missing model.layers.1.mlp.experts.7.down_proj.weight; "
                                     "unexpected model.layers.1.mlp.experts.9.down_proj.weight; Fix: "),
], ids=["expert-3-dropped", "expert-7-renamed-9"])
def test_an_export_with_an_expert_dropped_or_renumbered_is_refused_naming_its_keys(written, tmp_path, edit, says):
    url, _, store = written("qwen2_moe")
    export_hf(url, str(tmp_path / "hf"), include_optimizer=False, log=lambda *_: None)
    _edit_export(tmp_path / "hf", edit)
    with pytest.raises(CheckpointError) as refused:
        import_hf(str(tmp_path / "hf"), Store(store), "edited", log=lambda *_: None)
    message = str(refused.value)
    assert "\n" not in message and message.startswith("layers.1.feed_forward.experts.down.weight: stacking 8 tensors")
    assert says in message, message


@pytest.mark.parametrize("model, says", [
    (replace(QWEN2_MOE, router_scores="sigmoid"), "model.router_scores='sigmoid' is not what Qwen2MoeForCausalLM computes. "
                                                  "Fix: Qwen2MoeForCausalLM routes by softmax scores"),
    (replace(QWEN2_MOE, shared_expert_ffn_dim=0), "model.shared_expert_ffn_dim=0 is not what Qwen2MoeForCausalLM computes. "
                                                  "Fix: Qwen2MoeForCausalLM always adds a shared expert"),
    (replace(QWEN3_MOE, qk_norm=False), "model.qk_norm=False is not what Qwen3MoeForCausalLM computes"),
])
def test_an_moe_transformers_would_compute_otherwise_is_refused_at_export(tmp_path, model, says):
    url, _, _ = write_checkpoint(str(tmp_path / "store"), "src", model.validate(), steps=1)
    with pytest.raises(CheckpointError) as refused:
        export_hf(url, str(tmp_path / "hf"), log=lambda *_: None)
    assert str(refused.value).startswith(f"cannot export this {model.family} model: {says}")
    assert "\n" not in str(refused.value) and not (tmp_path / "hf").exists()


@pytest.mark.parametrize("change, field", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate_size=0"),
    ({"num_experts": 0}, "num_experts=0 (no expert layers: import it as a dense family)"),
])
def test_a_moe_config_rayshard_would_approximate_is_refused_naming_the_field(tmp_path, change, field):
    _hf_moe("qwen2_moe").save_pretrained(str(tmp_path / "hf"))
    settings = {**json.loads((tmp_path / "hf" / "config.json").read_text()), **change}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=re.escape(field)) as refused:
        import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "refused", log=lambda *_: None)
    assert "\n" not in str(refused.value)
