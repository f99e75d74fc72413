"""Each Hugging Face family rayshard computes: a random transformers model of that family imports,
exports back bit-identical with no training step, and our model computes its logits (fp32, 1e-5).

Sizes are chosen to catch what a family changes: grouped-query attention (6 heads over 2 kv
heads), a vocabulary that is no power of two (250), an explicit head size that is not
hidden / heads (Qwen3), and a sliding window shorter than the sequence (Mistral, Phi-3, Mixtral).
Phi-3 stores q/k/v and gate/up fused part after part (the mapping regroups the rows); Mixtral is
a mixture of experts in every layer (4 experts, top-2, renormalised weights). transformers'
loss on the tokens is rayshard's within 1e-6 relative.
"""
from __future__ import annotations

import inspect
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.actors.model.transformer import Transformer
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.cluster.catalog.store import Store
from rayshard.plans.errors import CheckpointError
from rayshard.plans.interop.hf_families import HF_DEFAULTS, SLIDING_WINDOW_FAMILIES
from rayshard.plans.training.model_spec import parameter_shapes

COMMON = dict(vocab_size=250, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": 8}),
    # Phi3Config's default pad id (32000) is past this vocabulary, which its embedding refuses.
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"sliding_window": 8, "pad_token_id": None}),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                {"sliding_window": 8, "num_local_experts": 4, "num_experts_per_tok": 2}),
}
SEQ = 24  # longer than Mistral's window


def hf_model(family: str, tied: bool, seed: int = 11):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_class(config_class(**COMMON, **extra, tie_word_embeddings=tied))
    with torch.no_grad():  # transformers starts biases and norms at 0 and 1: make every tensor tell
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model.eval()


def ours_from(url: str):
    stored = StoredCheckpoint(url)
    from rayshard.plans.checkpoint.model_check import check_against_own_model

    config = check_against_own_model(stored.chunks, stored.metadata, url)
    model = Transformer(config)
    state = {name: stored.read_region(name, "param", (0,) * len(shape), shape)
             for name, shape in parameter_shapes(config).items()}
    model.load_state_dict(state, strict=not config.tie_embeddings)
    return config, model.eval()


def assert_same_state(url: str, other_url: str) -> None:
    """Every parameter and both AdamW moments of two checkpoints of one model, element for element
    (an export with its moments, imported back, against the checkpoint it was exported from)."""
    config, _ = ours_from(url)
    first, second = StoredCheckpoint(url), StoredCheckpoint(other_url)
    for kind in ("param", "exp_avg", "exp_avg_sq"):
        for name, shape in parameter_shapes(config).items():
            origin = (0,) * len(shape)
            assert torch.equal(first.read_region(name, kind, origin, shape),
                               second.read_region(name, kind, origin, shape)), (kind, name)


CASES = [pytest.param(family, tied, id=f"{family}-{'tied' if tied else 'untied'}")
         for family in FAMILIES for tied in (False, True)]


@pytest.mark.parametrize("family, tied", CASES)
def test_import_computes_transformers_logits_and_exports_bit_identical(tmp_path, family, tied):
    reference = hf_model(family, tied)
    reference.save_pretrained(str(tmp_path / "hf"))
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda *_: None)
    config, ours = ours_from(url)
    assert (config.family, config.tie_embeddings) == (family, tied)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = ours(tokens)
        theirs = reference(tokens, labels=tokens)
        difference = (logits - theirs.logits).abs().max().item()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert difference <= 1e-5, difference
    assert abs(loss.item() - theirs.loss.item()) <= 1e-6 * theirs.loss.item(), (loss.item(), theirs.loss.item())

    export_hf(url, str(tmp_path / "again"), include_optimizer=False, log=lambda *_: None)
    # What save_pretrained wrote (Mixtral's experts per expert, not fused as in memory).
    again, original = load_file(str(tmp_path / "again" / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    if tied:
        original = {name: value for name, value in original.items() if name != "lm_head.weight"}
        again.pop("lm_head.weight", None)
    assert set(again) == set(original)
    for name, value in original.items():
        assert torch.equal(again[name], value), name
    exported = json.loads((tmp_path / "again" / "config.json").read_text())
    assert exported["model_type"] == family and exported["architectures"] == [type(reference).__name__]
    loaded = type(reference).from_pretrained(str(tmp_path / "again"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, reference(tokens).logits)


@pytest.mark.parametrize("family, change, field", [
    ("llama", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type='longrope'"),
    ("llama", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3", {"attention_bias": True}, "attention_bias=True"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window=True"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("gemma", {}, "model_type 'gemma' is not one rayshard computes"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}},
     "rope_parameters.partial_rotary_factor=0.75"),
    ("phi3", {"partial_rotary_factor": 0.5, "rope_parameters": None}, "partial_rotary_factor=0.5"),
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                  "long_factor": [1.0] * 4}}, "rope_parameters.rope_type='longrope'"),
    ("mixtral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
])
def test_a_config_rayshard_would_approximate_is_refused_naming_the_field(tmp_path, family, change, field):
    base = family if family in FAMILIES else "llama"
    hf_model(base, False).save_pretrained(str(tmp_path / "hf"))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    settings.update(change)
    if family not in FAMILIES:
        settings["model_type"] = family
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=field.replace("(", r"\(").replace("[", r"\[")):
        import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "refused", log=lambda *_: None)


HF_CLASSES = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
              "qwen3": transformers.Qwen3Config, "phi3": transformers.Phi3Config, "mixtral": transformers.MixtralConfig,
              "qwen2_moe": transformers.Qwen2MoeConfig, "qwen3_moe": transformers.Qwen3MoeConfig}


@pytest.mark.parametrize("family", list(HF_CLASSES))
def test_a_key_config_json_leaves_out_takes_the_transformers_classs_default(family):
    """HF_DEFAULTS is what each installed transformers config class takes for a missing key."""
    config_class = HF_CLASSES[family]
    made = config_class()
    signature = inspect.signature(config_class.__init__).parameters
    theirs = dict(rms_norm_eps=made.rms_norm_eps, max_position_embeddings=made.max_position_embeddings,
                  rope_theta=(getattr(made, "rope_parameters", None) or {}).get("rope_theta", getattr(made, "rope_theta", None)),
                  num_key_value_heads=signature["num_key_value_heads"].default)
    if family in SLIDING_WINDOW_FAMILIES:
        theirs["sliding_window"] = made.sliding_window
    assert {key: HF_DEFAULTS[family].get(key) for key in theirs} == theirs


@pytest.mark.parametrize("family, dropped", [("llama", ["rms_norm_eps"]), ("qwen2", ["rms_norm_eps"]),
                                             ("mixtral", ["rope_theta", "rope_parameters", "rope_scaling"])])
def test_a_model_whose_config_json_leaves_keys_out_computes_transformers_logits(tmp_path, family, dropped):
    reference = hf_model(family, False)
    with torch.no_grad():
        reference.model.embed_tokens.weight.mul_(1e-3)  # small activations: the norm's eps shows in the logits
    reference.save_pretrained(str(tmp_path / "hf"))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in dropped:
        settings.pop(key, None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    theirs = type(reference).from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()  # as transformers reads it
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "r", log=lambda *_: None)
    _, ours = ours_from(url)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("change, says", [
    ({"model_type": ["llama"]}, "model_type=['llama'] is not a name"),
    ({"layer_types": [["full_attention"], "full_attention"]}, "is not a list of names"),
    ({"rope_theta": 0.0, "rope_parameters": {"rope_type": "default", "rope_theta": 0.0}},
     "rope_parameters.rope_theta=0.0 is not a positive finite number"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": [1]}}, "rope_parameters.rope_theta=[1] is not a positive"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings='false' is not true or false"),
])
def test_a_malformed_config_value_is_refused_in_one_line_and_nothing_is_written(tmp_path, change, says):
    hf_model("llama", False).save_pretrained(str(tmp_path / "hf"))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    settings.update(change)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError) as refused:
        import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "bad", log=lambda *_: None)
    assert says in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert not (tmp_path / "store" / "bad").exists()


def test_a_tied_copy_that_differs_is_refused_before_anything_is_written(tmp_path):
    """A tied model's file holding lm_head.weight unequal to the embedding: refused in one line
    while the directory is checked, not after the import began writing into the run."""
    hf_model("llama", True).save_pretrained(str(tmp_path / "hf"))
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1.0
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lm_head.weight should be a tied copy of model.embed_tokens.weight"):
        import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "tied", log=lambda *_: None)
    assert not (tmp_path / "store" / "tied").exists()
