"""PEFT's LoRA format both ways, without training (tests/integration/test_peft_training.py trains).

A random transformers model of each family PEFT maps (Llama, Qwen2, Qwen3, Mistral) is imported
as a base; a PEFT adapter on every projection, with random A and B, is saved by `peft` itself and
imported onto it: our model with the imported adapters computes PEFT's logits (fp32, 1e-5), and
the PEFT export of that checkpoint is the adapter PEFT wrote, key for key and bit for bit, its
adapter_config.json the same settings. The merged export equals PEFT's merge_and_unload.
Bad input is refused in one line, and nothing is committed.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_interop import import_hf
from rayshard.cluster.checkpoint.lora_export import export_merged, export_peft
from rayshard.cluster.checkpoint.peft_import import import_peft
from rayshard.cluster.cli.main import main
from rayshard.storage.manifest_io import read_manifest
from tests.peft_models import ALL_MODULES, ATTENTION_MODULES, hf_model, our_model, peft_adapter

peft = pytest.importorskip("peft")
QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """family -> (store, base checkpoint URL, the HF directory, the PEFT directory), made once."""
    root = tmp_path_factory.mktemp("peft")
    store = Store(str(root / "store"))
    made = {}

    def get(family: str):
        if family not in made:
            model = hf_model(family)
            model.save_pretrained(str(root / f"{family}-hf"))
            base = import_hf(str(root / f"{family}-hf"), store, f"{family}-base", **QUIET)
            peft_adapter(model).save_pretrained(str(root / f"{family}-adapter"))
            made[family] = (store, base, root / f"{family}-hf", root / f"{family}-adapter")
        return made[family]
    return get


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_peft_adapter_imports_computes_peft_logits_and_exports_as_it_was(imported, tmp_path, family):
    store, base, hf_dir, adapter_dir = imported(family)
    url = import_peft(str(adapter_dir), store, f"{family}-adapter", base, **QUIET)
    chunks, metadata = read_manifest(url)
    assert metadata["step"] == 0 and metadata["lora"]["rank"] == 4 and metadata["lora"]["alpha"] == 8.0
    assert metadata["lora"]["targets"] == "q,k,v,o,gate,up,down" and metadata["lora_base"]["url"] == base
    assert {c.kind for c in chunks} == {"param", "exp_avg", "exp_avg_sq"}

    hf_base = type(hf_model(family)).from_pretrained(str(hf_dir), dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf_base, str(adapter_dir)).eval()
    tokens = torch.randint(0, 250, (2, 20), generator=torch.Generator().manual_seed(1))  # longer than Mistral's window
    with torch.no_grad():
        logits, expected = our_model(url)(tokens), theirs(tokens).logits
        plain = hf_model(family)(tokens).logits
    assert (expected - plain).abs().max() > 1e-2  # the adapters act: equal logits are not the base's
    assert (logits - expected).abs().max().item() <= 1e-5

    export_peft(url, str(tmp_path / "out"), **QUIET)
    written, original = load_file(str(tmp_path / "out" / "adapter_model.safetensors")), load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert sorted(written) == sorted(original) and all(key.startswith("base_model.model.model.layers.") for key in written)
    for key, value in original.items():
        assert torch.equal(written[key], value), key
    config, peft_config = (json.loads((d / "adapter_config.json").read_text()) for d in (tmp_path / "out", adapter_dir))
    for key in ("r", "lora_alpha", "lora_dropout", "peft_type", "bias", "use_rslora"):
        assert config[key] == peft_config[key], key
    assert sorted(config["target_modules"]) == sorted(peft_config["target_modules"]) == sorted(ALL_MODULES)


def test_the_merged_export_equals_peft_merge_and_unload(imported, tmp_path):
    import transformers

    store, base, hf_dir, adapter_dir = imported("llama")
    url = import_peft(str(adapter_dir), store, "to-merge", base, **QUIET)
    export_merged(url, str(tmp_path / "merged"), **QUIET)
    merged = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).state_dict()
    hf_base = transformers.LlamaForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    up = hf_base.state_dict()["model.layers.1.mlp.up_proj.weight"].clone()
    expected = peft.PeftModel.from_pretrained(hf_base, str(adapter_dir)).merge_and_unload().state_dict()
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert not torch.equal(merged["model.layers.1.mlp.up_proj.weight"], up)  # merged, not the base's
    # Another dtype: merged in float32 first, rounded once.
    export_merged(url, str(tmp_path / "bf16"), dtype="bfloat16", **QUIET)
    rounded = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    for name, value in load_file(str(tmp_path / "merged" / "model.safetensors")).items():
        assert torch.equal(rounded[name], value.to(torch.bfloat16)), name


@pytest.mark.parametrize("family, modules, expected_targets", [
    ("qwen2_moe", ALL_MODULES, ["q_proj", "k_proj", "v_proj", "o_proj", "mlp.gate_proj", "shared_expert.gate_proj",
                                "mlp.up_proj", "shared_expert.up_proj", "mlp.down_proj", "shared_expert.down_proj"]),
    ("mixtral", ATTENTION_MODULES, ATTENTION_MODULES),
])
def test_an_moe_models_adapter_goes_both_ways_and_peft_loads_our_export(tmp_path, family, modules, expected_targets):
    """Decision 169: attention, a dense layer's and a shared expert's projections are PEFT modules of
    the Hugging Face class; the export names the parent of each feed-forward module, so PEFT adapts
    exactly ours (no routed expert), and computes our logits."""
    store = Store(str(tmp_path / "store"))
    model = hf_model(family)
    model.save_pretrained(str(tmp_path / "hf"))
    base = import_hf(str(tmp_path / "hf"), store, "base", **QUIET)
    peft_adapter(model, modules).save_pretrained(str(tmp_path / "adapter"))
    url = import_peft(str(tmp_path / "adapter"), store, "adapter", base, **QUIET)

    def loaded(directory):
        hf_base = type(model).from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
        return peft.PeftModel.from_pretrained(hf_base, str(directory)).eval()

    tokens = torch.randint(0, 250, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, plain = our_model(url)(tokens), hf_model(family)(tokens).logits
        peft_logits = loaded(tmp_path / "adapter")(tokens).logits
    assert (peft_logits - plain).abs().max() > 1e-2  # the adapters act
    assert (ours - peft_logits).abs().max().item() <= 1e-5

    export_peft(url, str(tmp_path / "out"), **QUIET)
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["target_modules"] == expected_targets and (config["r"], config["lora_alpha"]) == (4, 8)
    written, original = (load_file(str(d / "adapter_model.safetensors")) for d in (tmp_path / "out", tmp_path / "adapter"))
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[key], value) for key, value in original.items())
    theirs = loaded(tmp_path / "out")
    adapted = sorted(name for name, _ in theirs.named_modules() if name.endswith(".lora_A"))
    assert adapted == sorted(name for name, _ in loaded(tmp_path / "adapter").named_modules() if name.endswith(".lora_A"))
    assert not any(".experts." in name for name in adapted)
    with torch.no_grad():
        assert (theirs(tokens).logits - ours).abs().max().item() <= 1e-5

    # The merged export merges a shared expert's adapters into its own projections.
    export_merged(url, str(tmp_path / "merged"), **QUIET)
    merged = type(model).from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).state_dict()
    expected = theirs.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(merged[name], value, rtol=0, atol=1e-6, msg=lambda m: f"{name}: {m}")


# ---- bad input, in one line, nothing committed ----------------------------------------------------


def _cli(capsys, *argv) -> tuple[int, str]:
    capsys.readouterr()  # what saving the models printed (transformers' progress bars)
    code = main(list(argv))
    error = capsys.readouterr().err.strip()
    return code, error


def _copy_adapter(source, target, config_change=None, rename=None):
    target.mkdir()
    config = json.loads((source / "adapter_config.json").read_text())
    config.update(config_change or {})
    (target / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(source / "adapter_model.safetensors"))
    save_file({(rename(k) if rename else k): v for k, v in tensors.items()}, str(target / "adapter_model.safetensors"))
    return target


@pytest.mark.parametrize("change, message", [
    (dict(config_change={"target_modules": ["q_proj", "lm_head"]}), "target_modules names ['lm_head'], which are no projection rayshard adapts"),
    (dict(config_change={"use_rslora": True}), "uses use_rslora=True, which rayshard's LoRA does not compute"),
    (dict(config_change={"peft_type": "IA3"}), "peft_type='IA3'; rayshard imports LoRA adapters only"),
    # The peers' bug: keys without PEFT's prefix (PEFT itself would load them as nothing).
    (dict(rename=lambda key: key.removeprefix("base_model.model.")), "under PEFT's prefix 'base_model.model.'"),
])
def test_a_bad_adapter_is_refused_in_one_line(imported, tmp_path, capsys, change, message):
    store, base, _, adapter_dir = imported("llama")
    bad = _copy_adapter(adapter_dir, tmp_path / "bad", **change)
    code, error = _cli(capsys, "ckpt", "import", "--format", "peft", str(bad), "--base", "llama-base", "--run", "bad",
                       "--store", store.url)
    assert code == 2 and "\n" not in error and message in error and "Fix:" in error, error
    assert store.committed_steps("bad") == []
    assert not Path(store.url, "bad").exists()  # checked before the run's writer lease: no run left behind


def test_an_adapter_of_another_base_is_refused_naming_the_shapes(imported, tmp_path, capsys):
    store, _, _, _ = imported("llama")
    other = hf_model("llama", intermediate_size=64)
    other.save_pretrained(str(tmp_path / "other-hf"))
    peft_adapter(other).save_pretrained(str(tmp_path / "other-adapter"))
    code, error = _cli(capsys, "ckpt", "import", "--format", "peft", str(tmp_path / "other-adapter"), "--base", "llama-base",
                       "--run", "other", "--store", store.url)
    assert code == 2 and "\n" not in error and "layers.0.feed_forward.lora.gate.b [64, 4] (the base's: [88, 4])" in error, error
    assert "import the adapter onto the base it was trained on" in error
    assert store.committed_steps("other") == []
    # Its base_model_name_or_path a local directory of another model: refused by that model's sizes.
    _copy_adapter(tmp_path / "other-adapter", tmp_path / "named", {"base_model_name_or_path": str(tmp_path / "other-hf")})
    code, error = _cli(capsys, "ckpt", "import", "--format", "peft", str(tmp_path / "named"), "--base", "llama-base",
                       "--run", "other", "--store", store.url)
    assert code == 2 and "\n" not in error and "differs from --base in ffn_dim (88 -> 64)" in error, error


def test_exports_refuse_what_they_cannot_write(imported, tmp_path, capsys):
    store, base, _, adapter_dir = imported("llama")
    import_peft(str(adapter_dir), store, "adapters", base, **QUIET)
    for argv, message in [
        (("llama-base", "--format", "peft"), "holds no LoRA adapters (it is not a LoRA run's checkpoint)"),
        (("llama-base", "--merge"), "holds no LoRA adapters"),
        (("adapters",), "is a LoRA run's checkpoint, which holds its adapters, not a model. Fix: export the adapters with "
                        "--format peft"),
        (("adapters", "--format", "dcp"), "is a LoRA run's checkpoint, which holds its adapters, not a model"),
        (("adapters", "--format", "peft", "--merge"), "--merge=True: does not apply to --format peft"),
    ]:
        code, error = _cli(capsys, "ckpt", "export", *argv, "--out", str(tmp_path / "never"), "--store", store.url)
        assert code == 2 and "\n" not in error and message in error, (argv, error)
        assert not (tmp_path / "never" / "adapter_model.safetensors").exists()
    code, error = _cli(capsys, "ckpt", "import", "--format", "peft", str(adapter_dir), "--run", "x", "--store", store.url)
    assert code == 2 and "--format peft needs the checkpoint holding the adapter's base weights" in error, error


def test_an_adapter_of_a_family_peft_names_otherwise_is_refused(tmp_path, capsys):
    """Phi-3's Hub modules fuse q/k/v: one PEFT adapter there spans three of ours."""
    store = Store(str(tmp_path / "store"))
    model = hf_model("phi3")
    model.save_pretrained(str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), store, "phi", **QUIET)
    peft_adapter(model, ["o_proj"]).save_pretrained(str(tmp_path / "adapter"))
    code, error = _cli(capsys, "ckpt", "import", "--format", "peft", str(tmp_path / "adapter"), "--base", "phi",
                       "--run", "x", "--store", store.url)
    assert code == 2 and "\n" not in error and "a PEFT adapter of a phi3 model is not supported" in error, error


def test_an_export_imported_onto_other_weights_of_the_same_shapes_is_refused(imported, tmp_path, capsys):
    """Shapes cannot tell two bases of one model apart; the base digest rayshard.json records can."""
    store, base, _, adapter_dir = imported("llama")
    url = import_peft(str(adapter_dir), store, "recorded", base, **QUIET)
    export_peft(url, str(tmp_path / "exported"), **QUIET)
    hf_model("llama", seed=12).save_pretrained(str(tmp_path / "other-hf"))
    import_hf(str(tmp_path / "other-hf"), store, "other-weights", **QUIET)
    code, error = _cli(capsys, "ckpt", "import", "--format", "peft", str(tmp_path / "exported"), "--base", "other-weights",
                       "--run", "moved", "--store", store.url)
    assert code == 2 and "\n" not in error and f"the adapter was trained on {base} with weight digest" in error, error
    assert store.committed_steps("moved") == []
    assert main(["ckpt", "import", "--format", "peft", str(tmp_path / "exported"), "--base", "llama-base", "--run", "moved",
                 "--store", store.url]) == 0
