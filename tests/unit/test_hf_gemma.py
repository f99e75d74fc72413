"""Gemma 2 (`Gemma2ForCausalLM`) and Gemma 3's text model (`Gemma3ForCausalLM`) as families of the
one decoder, with their switches: (1 + weight) RMSNorms in float32 around and after each sublayer,
the embedding times sqrt(hidden), GeGLU (gelu_pytorch_tanh), query_pre_attn_scalar, sliding and
full layers alternating, Gemma 2's attention and final-logit soft-capping, Gemma 3's q/k norms and
local/global RoPE (the global layers' rope scaling).

Random transformers models of odd size (3 layers, hidden 96, 6 heads over 2 kv heads of head_dim
24, not 96 / 6; vocabulary 1001; every norm perturbed; window 8 under a 40-token sequence; caps
small enough to bite) import, compute transformers' eager logits (1e-5) and loss (1e-6 relative),
export back bit-identical, and each switch changes the loss (so the comparison tests it).
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from rayshard.actors.model.swiglu import gate_up_geglu
from rayshard.actors.model.transformer import Transformer
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.plans.interop.hf_families import hf_mapping
from rayshard.plans.training.model_spec import parameter_shapes, preset
from tests.unit.test_hf_families import ours_from

SIZES = dict(vocab_size=1001, hidden_size=96, intermediate_size=136, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, head_dim=24, max_position_embeddings=64, sliding_window=8, query_pre_attn_scalar=20)
SEQ = 40  # five windows
FAMILIES = {
    # Gemma2's default layer types: sliding, full, sliding. Caps small enough that tanh bends the values.
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=4.0,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def gemma_model(family: str, tied: bool, seed: int = 3, **changes):
    config_class, model_class, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_class(**{**SIZES, **extra, **changes}, tie_word_embeddings=tied, attn_implementation="eager")
    model = model_class(config)
    with torch.no_grad():  # transformers starts the norms at 0: make every tensor tell
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model.eval()


def _tokens(seed: int = 2) -> torch.Tensor:
    return torch.randint(0, SIZES["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _imported(tmp_path, reference):
    reference.save_pretrained(str(tmp_path / "hf"))
    return import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda *_: None)


@pytest.mark.parametrize("family, tied", [("gemma2", True), ("gemma3", False)])
def test_a_gemma_directory_imports_computes_transformers_loss_and_exports_bit_identical(tmp_path, family, tied):
    reference = gemma_model(family, tied)
    url = _imported(tmp_path, reference)
    config, ours = ours_from(url)
    assert (config.family, config.norm, config.mlp, config.post_norms, config.embedding_scale, config.tie_embeddings,
            config.qk_norm, config.head_dim, config.layer_types) == (
        family, "rmsnorm_plus_one", "geglu_tanh", True, True, tied, family == "gemma3", 24,
        ("sliding_attention", "full_attention", "sliding_attention"))
    tokens = _tokens()
    with torch.no_grad():
        logits, theirs = ours(tokens), reference(tokens, labels=tokens)
        loss = _loss(logits, tokens)
    assert (logits - theirs.logits).abs().max().item() <= 1e-5
    assert abs(loss.item() - theirs.loss.item()) <= 1e-6 * theirs.loss.item(), (loss.item(), theirs.loss.item())

    export_hf(url, str(tmp_path / "again"), include_optimizer=False, log=lambda *_: None)
    again, original = load_file(str(tmp_path / "again" / "model.safetensors")), load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(again) == set(original)
    for name, value in original.items():
        assert torch.equal(again[name], value), name
    exported = json.loads((tmp_path / "again" / "config.json").read_text())
    assert exported["architectures"] == [type(reference).__name__]
    loaded = type(reference).from_pretrained(str(tmp_path / "again"), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, theirs.logits)


SWITCHES = {"gemma2": ({"attn_softcap": None}, {"logit_softcap": None}, {"query_pre_attn_scalar": None},
                       {"layer_types": None}, {"embedding_scale": False}),
            "gemma3": ({"rope_local_theta": None}, {"rope_scaling": None}, {"layer_types": None})}


@pytest.mark.parametrize("family", SWITCHES)
def test_each_gemma_switch_changes_the_loss(tmp_path, family):
    """The comparison with transformers above would catch a switch computed wrong: each one moves the loss."""
    config, ours = ours_from(_imported(tmp_path, gemma_model(family, tied=True)))
    tokens = _tokens()
    with torch.no_grad():
        loss = _loss(ours(tokens), tokens).item()
    for change in SWITCHES[family]:
        changed = Transformer(dataclasses.replace(config, **change).validate())
        changed.load_state_dict(ours.state_dict())
        with torch.no_grad():
            assert abs(_loss(changed.eval()(tokens), tokens).item() - loss) > 1e-4, change


def test_a_gemma3_config_in_transformers_4_spelling_imports_as_transformers_reads_it(tmp_path):
    """The Hub's Gemma 3 configs: rope_theta, rope_local_base_freq, rope_scaling and
    sliding_window_pattern, no layer_types or per-type rope_parameters."""
    gemma_model("gemma3", tied=True).save_pretrained(str(tmp_path / "hf"))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        settings.pop(key, None)
    settings.update(rope_theta=50000.0, rope_local_base_freq=500.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                    sliding_window_pattern=2)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    reference = transformers.Gemma3ForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda *_: None)
    config, ours = ours_from(url)
    assert (config.rope_theta, config.rope_local_theta, config.rope_scaling.factor, config.layer_types) == (
        50000.0, 500.0, 4.0, ("sliding_attention", "full_attention", "sliding_attention"))
    tokens = _tokens(7)
    with torch.no_grad():
        assert (ours(tokens) - reference(tokens).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family, change, field", [
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    ("gemma2", {"attention_bias": True}, "attention_bias=True"),
    ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ("gemma2", {"query_pre_attn_scalar": -1}, "query_pre_attn_scalar=-1"),
    ("gemma2", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types="),
    ("gemma2", {"model_type": "gemma3", "text_config": {"model_type": "gemma2"}}, "text_config=.* is not a Gemma 3 text"),
])
def test_a_gemma_config_rayshard_would_compute_otherwise_is_refused_in_one_line(tmp_path, family, change, field):
    gemma_model(family, tied=True).save_pretrained(str(tmp_path / "hf"))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    settings.update(change)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=field.replace("(", r"\(").replace("[", r"\[")) as refused:
        import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "refused", log=lambda *_: None)
    assert "\n" not in str(refused.value)


def test_the_switches_build_exactly_the_parameters_the_plan_names_and_norms_start_at_the_identity():
    config = preset("tiny", family="gemma3", norm="rmsnorm_plus_one", mlp="geglu_tanh", post_norms=True,
                    embedding_scale=True, qk_norm=True, sliding_window=8, rope_local_theta=1e4,
                    layer_types=("sliding_attention", "full_attention") * 2, tie_embeddings=True)
    model = Transformer(config)
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == list(parameter_shapes(config).items())
    assert {"layers.0.post_attention_norm.weight", "layers.3.post_ffn_norm.weight"} <= set(parameter_shapes(config))
    assert torch.equal(model.norm.weight, torch.zeros(64))  # (1 + 0): the identity scale
    hf_mapping(config)  # exportable as Gemma3ForCausalLM


def test_geglu_on_the_interleaved_rows_matches_plain_autograd():
    torch.manual_seed(0)
    x, weight = torch.randn(2, 5, 12, requires_grad=True), torch.randn(14, 12, requires_grad=True)
    plain = torch.nn.functional.gelu(x @ weight[0::2].t(), approximate="tanh") * (x @ weight[1::2].t())
    fused = gate_up_geglu(x, weight)
    assert torch.allclose(fused, plain, atol=1e-6)
    grad = torch.randn_like(plain)
    expected = torch.autograd.grad(plain, (x, weight), grad)
    for got, want in zip(torch.autograd.grad(fused, (x, weight), grad), expected):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("family, changes, setting", [
    ("gemma3", {"attn_softcap": 50.0}, "attn_softcap=50.0"),
    ("gemma2", {"rope_local_theta": 1e4}, "rope_local_theta=10000.0"),
    ("gemma2", {"post_norms": False}, "post_norms=False"),
])
def test_a_gemma_model_transformers_would_compute_otherwise_is_not_exported(family, changes, setting):
    base = dict(family=family, norm="rmsnorm_plus_one", mlp="geglu_tanh", post_norms=True, embedding_scale=True,
                qk_norm=family == "gemma3")
    with pytest.raises(CheckpointError, match=f"model.{setting} is not what"):
        hf_mapping(preset("tiny", **{**base, **changes}))


def test_gemma_switches_on_a_llama_are_not_exported_as_llama_and_bad_values_are_refused():
    with pytest.raises(CheckpointError, match="post_norms=True, logit_softcap=30.0 is not what LlamaForCausalLM computes"):
        hf_mapping(preset("tiny", post_norms=True, logit_softcap=30.0))
    with pytest.raises(ConfigError, match="model.layer_types"):
        preset("tiny", sliding_window=8, layer_types=("sliding_attention",))
    with pytest.raises(ConfigError, match="model.attn_softcap"):
        preset("tiny", attn_softcap=0.0)


def test_a_gemma3_conditional_generation_directory_imports_its_text_model(tmp_path):
    """Gemma 3 4B and up are Gemma3ForConditionalGeneration: the text model is imported (its
    logits on text are the whole model's), the vision tower and projector are left out and said
    so, and the export is a Gemma3ForCausalLM. transformers 5.24 saves it under 4.x's names
    (`language_model.model.`)."""
    text = {key: value for key, value in {**SIZES, **FAMILIES["gemma3"][2]}.items()}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(4)
    whole = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, attn_implementation="eager"))
    with torch.no_grad():
        for param in whole.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    whole.save_pretrained(str(tmp_path / "hf"))
    # What the directory holds (the in-memory head is not yet tied to the embedding it is saved as).
    whole = transformers.Gemma3ForConditionalGeneration.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                                        attn_implementation="eager").eval()
    said = []
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=said.append)
    assert any("vision tower and projector" in line for line in said), said
    config, ours = ours_from(url)
    # text_config's final_logit_softcapping (4.0) is not applied by the multimodal class, nor by the import.
    assert (config.family, config.tie_embeddings, config.rope_local_theta, config.logit_softcap) == ("gemma3", True, 1e4, None)
    tokens = _tokens(9)
    with torch.no_grad():
        theirs = whole(input_ids=tokens).logits
        assert (ours(tokens) - theirs).abs().max().item() <= 1e-5
    export_hf(url, str(tmp_path / "text"), include_optimizer=False, log=lambda *_: None)
    loaded = transformers.Gemma3ForCausalLM.from_pretrained(str(tmp_path / "text"), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        assert (loaded(tokens).logits - theirs).abs().max().item() <= 1e-5


def test_the_embedding_scale_is_rounded_to_the_embeddings_dtype_as_transformers_rounds_it():
    """sqrt(3072) = 55.43 is 55.5 in bf16: a bf16 Gemma's embedding is scaled by 55.5, as
    Gemma2TextScaledWordEmbedding scales it."""
    from rayshard.actors.model.transformer import embedding_scale

    assert embedding_scale(3072, torch.bfloat16) == 55.5 and embedding_scale(3072, torch.float32) == pytest.approx(55.4256, 1e-6)
    theirs = transformers.models.gemma2.modeling_gemma2.Gemma2TextScaledWordEmbedding(7, 3072, 0, embed_scale=3072 ** 0.5)
    theirs = theirs.to(torch.bfloat16)
    tokens = torch.arange(7)
    ours = torch.nn.functional.embedding(tokens, theirs.weight) * embedding_scale(3072, torch.bfloat16)
    assert torch.equal(ours, theirs(tokens))


def test_a_gemma_model_has_no_torchtitan_form():
    from rayshard.plans.interop.torchtitan import torchtitan_mapping

    with pytest.raises(CheckpointError, match="torchtitan's Llama has no place for Gemma's"):
        torchtitan_mapping(preset("tiny", post_norms=True, norm="rmsnorm"))


def test_lora_on_the_geglu_keeps_its_activation():
    """With gate or up adapted, LoRA computes the gated product itself: for Gemma with GELU, so at
    B = 0 the adapted model is the base exactly."""
    from rayshard.actors.model.lora import apply_lora
    from rayshard.plans.config.lora import LoraConfig

    config = preset("tiny", family="gemma2", norm="rmsnorm_plus_one", mlp="geglu_tanh", post_norms=True,
                    embedding_scale=True)
    torch.manual_seed(0)
    model = Transformer(config)
    tokens = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(tokens)
        apply_lora(model, config, LoraConfig(rank=4, targets="gate,up"))
        for name, param in model.named_parameters():  # as a run starts them: A random, B zero
            if name.endswith((".a", ".b")):
                param.normal_() if name.endswith(".a") else param.zero_()
        assert torch.equal(model(tokens), base)
