"""PEFT export of a user's model's adapters (`--model-factory`; decision 169): the GPT-2 example,
whose plan's hf_mapping renames (and transposes, GPT-2's Conv1D) attn.proj, mlp.fc and mlp.proj
and fuses q|k|v into c_attn. Adapters on the renamed modules export as PEFT adapters on
GPT2LMHeadModel's modules, which PEFT loads and computes our logits with (fp32, 1e-5), and the
merged export equals PEFT's merge_and_unload; an adapter on a fused q is refused in one line as a
PEFT adapter and merges into c_attn."""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from rayshard.actors.model.lora import apply_user_lora
from rayshard.actors.model.user_model import describe_factory, import_factory
from rayshard.cluster.checkpoint.hf_interop import export_hf
from rayshard.cluster.checkpoint.lora_export import export_merged, export_peft
from rayshard.cluster.cli.main import main
from rayshard.plans.config import LoraConfig
from tests.lora_checkpoints import commit_lora_checkpoint
from tests.unit.checkpoint_factory import write_user_checkpoint

peft = pytest.importorskip("peft")
FACTORY = "examples.gpt2.model:tiny_gpt2"
QUIET = dict(log=lambda *_: None)


def _lora_checkpoint(store_url: str, run: str, base_url: str, base_model, lora: LoraConfig):
    """A LoRA checkpoint of the example as a run writes it. Returns (url, our adapted model)."""
    spec = describe_factory(FACTORY)
    model = import_factory(FACTORY)().module
    model.load_state_dict(base_model.state_dict())
    apply_user_lora(model, spec, lora)
    return commit_lora_checkpoint(store_url, run, base_url=base_url, model=model, model_description=spec.to_dict(),
                                  lora=lora, vocab_size=256), model.eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft-user")
    url, model, _ = write_user_checkpoint(str(root / "store"), "gpt2", FACTORY, seed=3)
    export_hf(url, str(root / "hf"), **QUIET)
    return root, url, model


def test_adapters_on_renamed_modules_load_in_peft_and_merge_as_peft_merges(base, tmp_path):
    root, base_url, base_model = base
    lora = LoraConfig(rank=4, alpha=8.0, targets="o,up,down", base=base_url)
    url, ours = _lora_checkpoint(str(root / "store"), "adapt", base_url, base_model, lora)
    export_peft(url, str(tmp_path / "peft"), **QUIET)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == [f"transformer.h.{i}.{m}" for i in range(4)
                                        for m in ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    assert (config["r"], config["lora_alpha"], config["fan_in_fan_out"]) == (4, 8, True)

    def hf():
        return transformers.GPT2LMHeadModel.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()

    theirs = peft.PeftModel.from_pretrained(hf(), str(tmp_path / "peft")).eval()
    tokens = torch.randint(0, 256, (3, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, plain, logits = ours(tokens), hf()(tokens).logits, theirs(tokens).logits
    assert (logits - plain).abs().max() > 1e-2  # loaded, not a no-op
    assert (logits - expected).abs().max().item() <= 1e-5

    export_merged(url, str(tmp_path / "merged"), **QUIET)  # GPT-2's Conv1D weights: the delta transposed
    merged = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).state_dict()
    reference = theirs.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(reference)
    for name, value in reference.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_an_adapter_on_a_fused_module_is_refused_in_one_line(base, tmp_path, capsys):
    root, base_url, base_model = base
    lora = LoraConfig(rank=4, alpha=8.0, targets="q,o", base=base_url)
    _lora_checkpoint(str(root / "store"), "fused", base_url, base_model, lora)
    capsys.readouterr()
    code = main(["ckpt", "export", "fused", "--format", "peft", "--out", str(tmp_path / "never"), "--store", str(root / "store")])
    error = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in error, error
    assert "makes blocks.0.attn.q.weight part of transformer.h.0.attn.c_attn.weight" in error and "--merge" in error, error
    assert not (tmp_path / "never" / "adapter_model.safetensors").exists()


def test_an_adapter_on_a_fused_module_merges_before_the_fusion(base, tmp_path):
    """The way out the refusal above names: the merged export adds q's delta to the model's own
    weight before its hf_mapping fuses it into c_attn (decision 229)."""
    root, base_url, base_model = base
    lora = LoraConfig(rank=4, alpha=8.0, targets="q,o", base=base_url)
    url, ours = _lora_checkpoint(str(root / "store"), "fused-merge", base_url, base_model, lora)
    export_merged(url, str(tmp_path / "merged"), **QUIET)
    tokens = torch.randint(0, 256, (3, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        merged = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()(tokens).logits
        plain = transformers.GPT2LMHeadModel.from_pretrained(str(root / "hf"), dtype=torch.float32).eval()(tokens).logits
        expected = ours(tokens)
    assert (expected - plain).abs().max() > 1e-2
    assert (merged - expected).abs().max().item() <= 1e-5
