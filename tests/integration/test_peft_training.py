"""PEFT interop of trained adapters, on real Ray ranks: a random transformers Llama of odd sizes
(3 layers, 6 heads over 2 kv heads, vocabulary 1001, hidden 96) imported as the base.

- A LoRA run of a few steps on tp2 (B off zero, each adapter's B split over the ranks): its PEFT
  export loads with `PeftModel.from_pretrained` onto the original Hugging Face directory and onto
  the base's own Hugging Face export, and computes our logits (fp32, 1e-5), which are not the
  base's; adapter_config.json holds our rank, alpha, dropout and targets; the merged export
  equals PEFT's merge_and_unload (1e-6).
- An adapter trained by `peft` itself in a plain loop imports and continues: the first loss of
  the resumed rayshard run is PEFT's on the same batch (1e-6 relative).
"""
from __future__ import annotations

import json

import pytest
import torch
import transformers

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_interop import import_hf
from rayshard.cluster.cli.main import main
from rayshard.plans.config import LoraConfig, ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.storage.manifest_io import read_manifest
from tests.conftest import small_config
from tests.peft_models import ALL_MODULES, our_model

peft = pytest.importorskip("peft")
SIZES = dict(vocab_size=1001, hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
LORA = LoraConfig(rank=4, alpha=12.0, base="base")
BATCH, SEQ = 4, 16


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(tmp root, store, base checkpoint URL, its model) from a random Llama's directory."""
    root = tmp_path_factory.mktemp("peft-training")
    torch.manual_seed(5)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SIZES))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    model.save_pretrained(str(root / "hf"))
    store = Store(str(root / "store"))
    url = import_hf(str(root / "hf"), store, "base", log=lambda *_: None)
    return root, store, url, ModelConfig.from_dict(read_manifest(url)[1]["model"])


def _config(root, spec, layout=ParallelLayout(), **overrides):
    return small_config(root, layout, model=ModelChoice("custom", spec), global_batch=BATCH, seq_len=SEQ,
                        **overrides)


def _hf(directory):
    return transformers.LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def test_trained_adapters_load_in_peft_and_merge_as_peft_merges(run_training, base, capsys):
    root, store, base_url, spec = base
    run = run_training(_config(root, spec, layout=ParallelLayout(tp=2), run="adapt", steps=3, lora=LORA))
    adapters = run.checkpoints[-1]
    model = our_model(adapters)
    assert all(param.abs().sum() > 0 for name, param in model.named_parameters() if name.endswith(".b"))

    assert main(["ckpt", "export", "adapt", "--format", "peft", "--out", str(root / "peft"), "--store", store.url]) == 0
    assert main(["ckpt", "export", "base", "--out", str(root / "base-hf"), "--no-optimizer", "--store", store.url]) == 0
    config = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (LORA.rank, LORA.alpha, LORA.dropout)
    assert sorted(config["target_modules"]) == sorted(ALL_MODULES) and LORA.targets == "q,k,v,o,gate,up,down"
    assert config["base_model_name_or_path"] == str(root / "hf")  # the directory the base was imported from

    tokens = torch.randint(0, SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
        for base_dir in (root / "hf", root / "base-hf"):
            plain = _hf(base_dir)
            base_logits = plain(tokens).logits
            theirs = peft.PeftModel.from_pretrained(plain, str(root / "peft")).eval()(tokens).logits
            assert (theirs - base_logits).abs().max() > 1e-3, base_dir  # loaded, not a no-op
            assert (theirs - ours).abs().max().item() <= 1e-5, base_dir

    assert main(["ckpt", "export", "adapt", "--merge", "--out", str(root / "merged"), "--store", store.url]) == 0
    merged = _hf(root / "merged").state_dict()
    expected = peft.PeftModel.from_pretrained(_hf(root / "hf"), str(root / "peft")).merge_and_unload().state_dict()
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    capsys.readouterr()


def test_an_adapter_trained_by_peft_imports_and_continues(run_training, base):
    from rayshard.actors.training.data import global_batch, load_corpus

    root, store, base_url, spec = base
    hf = _hf(root / "hf")
    trained = peft.get_peft_model(hf, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"]))
    optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(9)
    trained.train()
    for _ in range(3):  # a plain loop, B moves off zero
        tokens = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ + 1), generator=generator)
        loss = trained(tokens[:, :-1], labels=tokens[:, :-1]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    trained.eval()
    trained.save_pretrained(str(root / "peft-trained"))

    assert main(["ckpt", "import", "--format", "peft", str(root / "peft-trained"), "--base", "base", "--run", "tuned",
                 "--store", store.url]) == 0
    config = _config(root, spec, run="tuned", steps=1, resume="latest")  # its LoRA settings and base from the checkpoint
    continued = run_training(config)
    assert continued.start_step == 0
    inputs, targets = global_batch(load_corpus(config.data.source, config.data.max_bytes), config.seed, 0, BATCH, SEQ)
    with torch.no_grad():
        logits = trained(inputs).logits
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()
    assert abs(continued.losses[1] - expected) <= 1e-6 * expected, (continued.losses[1], expected)
    metadata = read_manifest(continued.checkpoints[-1])[1]
    assert metadata["lora"]["rank"] == 8 and metadata["lora"]["targets"] == "q,v,down"
    assert metadata["lora_base"]["url"] == base_url


@pytest.mark.slow
def test_a_trained_adapter_of_the_built_in_moe_loads_in_peft(run_training, tmp_path, capsys):
    """moe-tiny (Qwen2-MoE's layout: layers 1 and 3 MoE with a shared expert) trained with LoRA on
    tp2: its PEFT export loads onto the base's own Hugging Face export (Qwen2MoeForCausalLM), on the
    attention, dense and shared-expert projections only, and computes our logits (decision 169)."""
    store = str(tmp_path / "store")
    moe = dict(model=ModelChoice.named("moe-tiny"), seq_len=16, global_batch=4)
    run_training(small_config(tmp_path, ParallelLayout(), run="base", steps=1, **moe))
    run = run_training(small_config(tmp_path, ParallelLayout(tp=2), run="adapt", steps=3, lora=LORA, **moe))
    assert main(["ckpt", "export", "adapt", "--format", "peft", "--out", str(tmp_path / "peft"), "--store", store]) == 0
    assert main(["ckpt", "export", "base", "--out", str(tmp_path / "base-hf"), "--no-optimizer", "--store", store]) == 0
    plain = transformers.Qwen2MoeForCausalLM.from_pretrained(str(tmp_path / "base-hf"), dtype=torch.float32).eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base_logits = plain(tokens).logits
        theirs = peft.PeftModel.from_pretrained(plain, str(tmp_path / "peft")).eval()
        logits, ours = theirs(tokens).logits, our_model(run.checkpoints[-1])(tokens)
    adapted = {name.split(".lora_A")[0].removeprefix("base_model.model.model.") for name, _ in theirs.named_modules()
               if name.endswith(".lora_A")}
    assert len(adapted) == 4 * 4 + 2 * 3 + 2 * 3 and not any(".experts." in name for name in adapted)
    assert {name for name in adapted if "shared_expert" in name} == {f"layers.{i}.mlp.shared_expert.{p}_proj"
                                                                     for i in (1, 3) for p in ("gate", "up", "down")}
    assert (logits - base_logits).abs().max() > 1e-3  # loaded, not a no-op
    assert (logits - ours).abs().max().item() <= 1e-5
    capsys.readouterr()
