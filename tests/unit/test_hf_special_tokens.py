"""Exports carry the special tokens: an imported model's bos / eos / pad ids (Mistral's 1 and 2)
come back in config.json and a generation_config.json that transformers reads, so generate()
stops at eos; a model with none of its own takes its tokenizer's, and `rayshard ckpt generate`
stops there too.

To see generation stop, the weights are set so that every position predicts eos by a wide
margin: attention and MLP outputs zeroed (the residual stream is the embedding), the embedding's
first component large and positive, the final norm keeping only that component, and the LM head
mapping it to eos alone. Without a known eos, generation runs to max_new_tokens.
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_generate import generate_ids
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.cluster.data.tokenizer import END_OF_DOCUMENT, save_tokenizer, train_tokenizer
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.plans.training.special_tokens import SpecialTokens

SIZES = dict(vocab_size=300, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=64)
NEW_TOKENS = 6


def always_predicts(model, token: int):
    """`model` (a transformers causal LM, untied) changed to predict `token` at every position."""
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 10.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[token, 0] = 100.0
    return model.eval()


@pytest.mark.parametrize("bos, eos, pad", [(1, 2, None), (5, 7, 0)])
def test_an_imported_models_special_tokens_come_back_and_generation_stops_at_eos(tmp_path, bos, eos, pad):
    config = transformers.MistralConfig(**SIZES, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, sliding_window=None)
    torch.manual_seed(3)
    always_predicts(transformers.MistralForCausalLM(config), eos).save_pretrained(str(tmp_path / "hf"))
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda *_: None)
    recorded = ModelConfig.from_dict(StoredCheckpoint(url).metadata["model"]).special_tokens
    assert recorded == SpecialTokens(bos, eos, pad)

    export_hf(url, str(tmp_path / "out"), include_optimizer=False, log=lambda *_: None)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"], exported.get("pad_token_id")) == (bos, eos, pad)
    generation = transformers.GenerationConfig.from_pretrained(str(tmp_path / "out"))
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (bos, eos, pad)

    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    prompt = torch.tensor([[3, 4, 9]])
    output = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert output[0].tolist() == [3, 4, 9, eos]  # stopped at eos, not NEW_TOKENS long


def test_a_model_with_no_ids_of_its_own_exports_its_tokenizers_and_ckpt_generate_stops_there(tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    tokenizer = train_tokenizer([str(tmp_path / "text.txt")], SIZES["vocab_size"])
    eos = tokenizer.eos_id
    config = transformers.LlamaConfig(**SIZES)
    torch.manual_seed(4)
    always_predicts(transformers.LlamaForCausalLM(config), eos).save_pretrained(str(tmp_path / "hf"))
    save_tokenizer(tokenizer, str(tmp_path / "hf"))
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # a config that names none
        settings.pop(key, None)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    (tmp_path / "hf" / "generation_config.json").unlink(missing_ok=True)
    url = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda *_: None)
    assert ModelConfig.from_dict(StoredCheckpoint(url).metadata["model"]).special_tokens is None

    export_hf(url, str(tmp_path / "out"), include_optimizer=False, log=lambda *_: None)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    # our tokenizer_config.json names the end-of-document token as bos too (GPT-2's convention)
    assert exported["eos_token_id"] == exported["bos_token_id"] == eos == 0
    assert transformers.GenerationConfig.from_pretrained(str(tmp_path / "out")).eos_token_id == eos
    loaded, ids = generate_ids(str(tmp_path / "out"), "the quick", max_new_tokens=NEW_TOKENS)
    prompt = loaded("the quick", add_special_tokens=False)["input_ids"]
    assert ids == prompt + [eos] and loaded.convert_ids_to_tokens(eos) == END_OF_DOCUMENT
