"""A user model's Hugging Face export through its plan's mapping: transformers' GPT2LMHeadModel
loads the GPT-2 example's export and computes our logits; every tensor (weights and AdamW
moments) lands where the mapping says, checked by value against our own tensors; a plan without
a mapping is refused saying how to add one."""
import json
from dataclasses import replace

import pytest
import torch
import transformers
from safetensors.torch import load_file

from rayshard.cluster.checkpoint.digest import digest_checkpoint
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.cluster.catalog.store import Store
from examples.gpt2.model import tiny_gpt2
from rayshard.plans.errors import CheckpointError, ConfigError
from tests.unit.checkpoint_factory import write_user_checkpoint

FACTORY = "examples.gpt2.model:tiny_gpt2"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("user-hf") / "store")
    url, model, optimizer = write_user_checkpoint(store, "gpt2", FACTORY, seed=3)
    out = tmp_path_factory.mktemp("export") / "hf"
    export_hf(url, str(out), max_shard_bytes=200_000, log=lambda *_: None)  # sharded: several files and an index
    return url, model, optimizer, out, store


def test_transformers_gpt2_loads_the_export_and_computes_our_logits(written):
    _, model, _, out, _ = written
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(out), dtype=torch.float32).eval()
    model.eval()
    tokens = torch.randint(0, 256, (3, 37), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert ours.shape == theirs.shape == (3, 37, 256)
    assert ours.std() > 0.1  # random weights give logits of real size, not near-zero noise
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["torch_dtype"] == "float32"
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()  # untied, as ours


def _load_all(out, file: str) -> dict[str, torch.Tensor]:
    """One safetensors file, or all the shards its index lists."""
    index = out / file.replace(".safetensors", ".safetensors.index.json")
    if not index.exists():
        return load_file(str(out / file))
    shards = set(json.loads(index.read_text())["weight_map"].values())
    return {n: t for shard in shards for n, t in load_file(str(index.parent / shard)).items()}


def _expected_hf_tensors(ours: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """GPT-2's layout written out by hand (independent of the mapping rules)."""
    out = {"transformer.wte.weight": ours["wte.weight"], "transformer.wpe.weight": ours["wpe.weight"],
           "transformer.ln_f.weight": ours["norm.weight"], "transformer.ln_f.bias": ours["norm.bias"],
           "lm_head.weight": ours["lm_head.weight"]}
    for i in range(layers):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        out[h + "ln_1.weight"], out[h + "ln_1.bias"] = ours[b + "attn_norm.weight"], ours[b + "attn_norm.bias"]
        out[h + "ln_2.weight"], out[h + "ln_2.bias"] = ours[b + "mlp_norm.weight"], ours[b + "mlp_norm.bias"]
        out[h + "attn.c_attn.weight"] = torch.cat([ours[b + f"attn.{p}.weight"] for p in "qkv"]).T
        out[h + "attn.c_attn.bias"] = torch.cat([ours[b + f"attn.{p}.bias"] for p in "qkv"])
        for theirs, mine in (("attn.c_proj", "attn.proj"), ("mlp.c_fc", "mlp.fc"), ("mlp.c_proj", "mlp.proj")):
            out[h + theirs + ".weight"] = ours[b + mine + ".weight"].T
            out[h + theirs + ".bias"] = ours[b + mine + ".bias"]
    return out


def test_every_weight_and_moment_is_exported_bit_exactly_where_gpt2_keeps_it(written):
    _, model, optimizer, out, _ = written
    params = dict(model.named_parameters())
    states = {"model.safetensors": {n: p.detach() for n, p in params.items()}}
    for moment in ("exp_avg", "exp_avg_sq"):
        states[f"rayshard-optimizer/{moment}.safetensors"] = {n: optimizer.state[p][moment] for n, p in params.items()}
    for file, ours in states.items():
        expected = _expected_hf_tensors(ours, layers=4)
        found = _load_all(out, file)
        assert sorted(found) == sorted(expected), file
        for name, tensor in expected.items():
            assert torch.equal(found[name], tensor.contiguous()), f"{file}: {name}"
    # attn.c_proj is square ([64, 64]): only the values tell a missing transpose, and they differ.
    assert not torch.equal(found["transformer.h.0.attn.c_proj.weight"], ours["blocks.0.attn.proj.weight"])


def test_a_bfloat16_export_casts_the_weights_and_keeps_the_moments(written, tmp_path):
    url, model, optimizer, _, _ = written
    export_hf(url, str(tmp_path / "bf16"), dtype="bfloat16", log=lambda *_: None)
    weights = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights["transformer.h.2.mlp.c_fc.weight"],
                       dict(model.named_parameters())["blocks.2.mlp.fc.weight"].detach().T.to(torch.bfloat16))
    moments = load_file(str(tmp_path / "bf16" / "rayshard-optimizer" / "exp_avg.safetensors"))
    assert {t.dtype for t in moments.values()} == {torch.float32}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def without_mapping():
    made = tiny_gpt2()
    return type(made)(made.module, replace(made.plan, hf_mapping=None, hf_config=None))


def test_a_user_model_without_a_mapping_is_refused_saying_how_to_add_one(tmp_path):
    url, _, _ = write_user_checkpoint(str(tmp_path / "store"), "plain", f"{__name__}:without_mapping")
    with pytest.raises(ConfigError, match=r"no Hugging Face mapping\. Fix: give its ModelPlan hf_mapping") as error:
        export_hf(url, str(tmp_path / "out"), log=lambda *_: None)
    assert "\n" not in str(error.value)
    assert not (tmp_path / "out" / "config.json").exists()


def test_import_of_the_export_is_the_same_checkpoint_through_the_recorded_plan(written, tmp_path):
    url, _, _, out, store = written
    imported = import_hf(str(out), Store(store), "back", log=lambda *_: None)
    assert digest_checkpoint(imported) == digest_checkpoint(url)  # weights and both moments, bit for bit


def test_a_gpt2_directory_without_rayshard_metadata_imports_as_the_built_in_gpt2_family(written, tmp_path):
    """Without the record naming the factory, the example's export is a plain GPT-2 directory: the
    built-in decoder's gpt2 family (decision 132) imports it, untied, and computes its logits."""
    from rayshard.actors.checkpoint.stored import StoredCheckpoint
    from rayshard.actors.model.transformer import Transformer
    from rayshard.plans.training.model_spec import ModelConfig, parameter_shapes

    _, model, _, out, store = written
    bare = tmp_path / "bare"
    bare.mkdir()
    files = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"].values()
    for file in ("config.json", "model.safetensors.index.json", *set(files)):
        (bare / file).write_bytes((out / file).read_bytes())
    stored = StoredCheckpoint(import_hf(str(bare), Store(store), "bare", log=lambda *_: None))
    config = ModelConfig.from_dict(stored.metadata["model"])
    assert (config.family, config.user, config.tie_embeddings) == ("gpt2", None, False)
    built = Transformer(config)
    built.load_state_dict({name: stored.read_region(name, "param", (0,) * len(shape), shape)
                           for name, shape in parameter_shapes(config).items()})
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(12))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(built.eval()(tokens), model(tokens), rtol=0, atol=1e-5)
