"""`ckpt export --merge` of families whose Hugging Face export fuses the projections our
adapters sit on: Phi-3 (qkv_proj, gate_up_proj) and GPT-2 (c_attn, a Conv1D). Each adapter's
delta is added where its projection's weight stands alone in the export mapping, before the
fusion (decision 229): transformers' own class, loaded from the merged directory, computes the
logits of our model with its adapters (fp32, 1e-5), and those are not the base's."""
from __future__ import annotations

import pytest
import torch
import transformers

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.actors.model.lora import apply_lora
from rayshard.actors.model.transformer import Transformer
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_interop import import_hf
from rayshard.cluster.checkpoint.lora_export import export_merged
from rayshard.plans.checkpoint.model_check import check_against_own_model
from rayshard.plans.config import LoraConfig
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.storage.manifest_io import read_manifest
from tests.lora_checkpoints import commit_lora_checkpoint
from tests.peft_models import hf_model, our_model

QUIET = dict(log=lambda *_: None)
VOCAB = 250


def _gpt2():
    torch.manual_seed(5)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=48, n_layer=2,
                                                                 n_head=6, activation_function="gelu_new"))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return model.eval()


FAMILIES = {"phi3": (lambda: hf_model("phi3"), transformers.Phi3ForCausalLM),
            "gpt2": (_gpt2, transformers.GPT2LMHeadModel)}


@pytest.mark.parametrize("family, targets", [("phi3", "q,k,v,o,gate,up,down"), ("phi3", "v,up"), ("gpt2", "q,k,v,o"),
                                             ("gpt2", "k")])
def test_a_merge_into_fused_projections_computes_our_adapted_logits(tmp_path, family, targets):
    make_hf, hf_class = FAMILIES[family]
    make_hf().save_pretrained(str(tmp_path / "hf"))
    store = Store(str(tmp_path / "store"))
    base_url = import_hf(str(tmp_path / "hf"), store, "base", **QUIET)
    chunks, metadata = read_manifest(base_url)
    spec = check_against_own_model(chunks, metadata, base_url)
    model = Transformer(ModelConfig.from_dict(metadata["model"]))
    lora = LoraConfig(rank=4, alpha=8.0, targets=targets, base=base_url)
    apply_lora(model, spec, lora)
    base = StoredCheckpoint(base_url)
    model.load_state_dict({name: base.read_region(name, "param", (0,) * param.dim(), tuple(param.shape))
                           for name, param in model.named_parameters() if ".lora." not in name},
                          strict=False)
    url = commit_lora_checkpoint(store.url, "adapt", model, metadata["model"], lora, base_url, VOCAB)

    export_merged(url, str(tmp_path / "merged"), **QUIET)
    merged = hf_class.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ours, theirs = our_model(url)(tokens), merged(tokens).logits
        plain = hf_class.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()(tokens).logits
    assert (ours - plain).abs().max() > 1e-2  # the adapters act
    assert (theirs - ours).abs().max().item() <= 1e-5
