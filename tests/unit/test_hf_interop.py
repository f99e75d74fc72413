"""Hugging Face export and import: transformers loads the export and computes our logits; an
import of the export is the same checkpoint, digest for digest (weights and optimizer moments)."""
import json

import pytest
import torch
import transformers

from safetensors.torch import load_file, save_file

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.cluster.checkpoint.digest import digest_checkpoint
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.cluster.catalog.store import Store
from rayshard.plans.errors import CheckpointError
from rayshard.plans.training.model_spec import preset
from tests.unit.checkpoint_factory import write_checkpoint


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """One trained checkpoint per tie setting, shared by the module: (url, model, store URL)."""
    cache = {}

    def get(tied: bool):
        if tied not in cache:
            store = str(tmp_path_factory.mktemp("hf-store") / "store")
            url, model, _ = write_checkpoint(store, "src", preset("tiny", tie_embeddings=tied))
            cache[tied] = (url, model, store)
        return cache[tied]
    return get


def _hf_logits(directory, tokens):
    model = transformers.LlamaForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_loads_the_export_and_computes_our_logits(written, tmp_path, tied):
    config = preset("tiny", tie_embeddings=tied)
    url, model, _ = written(tied)
    export_hf(url, str(tmp_path / "hf"), log=lambda *_: None)
    tokens = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(tokens)
    theirs = _hf_logits(tmp_path / "hf", tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["tie_word_embeddings"] is tied


def test_a_sharded_export_has_an_index_and_still_loads(written, tmp_path):
    config = preset("tiny")
    url, model, _ = written(False)
    result = export_hf(url, str(tmp_path / "hf"), max_shard_bytes=200_000, log=lambda *_: None)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    weight_files = {f for f in result.files if f.startswith("model-")}
    assert len(weight_files) > 1 and set(index["weight_map"].values()) == weight_files
    tokens = torch.randint(0, config.vocab_size, (1, 16))
    with torch.no_grad():
        assert (model(tokens) - _hf_logits(tmp_path / "hf", tokens)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tied", [False, True])
def test_import_of_the_export_has_the_same_digests(written, tmp_path, tied):
    url, _, store = written(tied)
    export_hf(url, str(tmp_path / "hf"), max_shard_bytes=300_000, log=lambda *_: None)
    imported = import_hf(str(tmp_path / "hf"), Store(store), "imported", log=lambda *_: None)
    assert imported.endswith("step-00000002")  # the step travels in rayshard.json
    assert digest_checkpoint(imported) == digest_checkpoint(url)


def test_a_plain_bf16_hf_directory_imports_as_float32_with_fresh_moments(tmp_path):
    hf_config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(1)
    reference = transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16)
    reference.save_pretrained(str(tmp_path / "plain"))
    url = import_hf(str(tmp_path / "plain"), Store(str(tmp_path / "store")), "plain", log=lambda *_: None)
    stored = StoredCheckpoint(url)
    assert stored.metadata["step"] == 0
    qkv = stored.read_region("layers.0.attention.qkv.weight", "param", (0, 0), (128, 64))
    assert qkv.dtype == torch.float32  # cast up for training
    assert not stored.read_region("layers.0.attention.qkv.weight", "exp_avg", (0, 0), (128, 64)).any()
    # Back to bfloat16 for Hugging Face: every weight is bit-identical to the original.
    export_hf(url, str(tmp_path / "again"), dtype="bfloat16", log=lambda *_: None)
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    original = reference.state_dict()
    assert set(again) == set(original)
    assert all(torch.equal(again[name], original[name]) for name in again)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_a_bf16_run_exports_in_the_dtype_asked(tmp_path, dtype):
    """A run stored in bfloat16, exported with --dtype float16 or float32: its tensors are cast to
    that dtype (config.json says so too), not written as bfloat16 under another name."""
    hf_config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(2)
    reference = transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16)
    reference.save_pretrained(str(tmp_path / "plain"))
    url = import_hf(str(tmp_path / "plain"), Store(str(tmp_path / "store")), "bf", dtype="bfloat16", log=lambda *_: None)
    export_hf(url, str(tmp_path / "out"), dtype=dtype, include_optimizer=False, log=lambda *_: None)
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == dtype
    original = reference.state_dict()
    assert {str(tensor.dtype) for tensor in exported.values()} == {f"torch.{dtype}"}
    assert all(torch.equal(exported[name], original[name].to(getattr(torch, dtype))) for name in exported)


def test_import_lists_missing_and_unexpected_tensors_together(written, tmp_path):
    url, _, _ = written(False)
    export_hf(url, str(tmp_path / "hf"), include_optimizer=False, log=lambda *_: None)
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    settings["num_hidden_layers"] = 5  # the config promises a layer the weights lack
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match=r"missing keys \(6\): layers.4"):
        import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "bad", log=lambda *_: None)


def test_import_refuses_models_ours_cannot_compute(written, tmp_path):
    url, _, _ = written(False)
    export_hf(url, str(tmp_path / "hf"), include_optimizer=False, log=lambda *_: None)
    settings = json.loads((tmp_path / "hf" / "config.json").read_text())
    settings["attention_bias"] = True
    (tmp_path / "hf" / "config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match="attention_bias=True"):
        import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "bad", log=lambda *_: None)


def _edit_json(path, change):
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def _set(key, value):
    return lambda document: document.__setitem__(key, value)


def _drop(key):
    return lambda document: document.pop(key)


def _damage_header(directory, change):
    """Rewrite model.safetensors with its JSON header edited by `change` (the data left as is)."""
    path = directory / "model.safetensors"
    data = path.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    change(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data[8 + length:])


def _first_tensor(change):
    return lambda header: change(header[next(name for name in header if name != "__metadata__")])


DAMAGED_DIRECTORIES = {
    "config not JSON": (lambda d: (d / "config.json").write_bytes(b"{'model_type': 'llama'"), "config.json: is not valid JSON"),
    "config a list": (lambda d: (d / "config.json").write_text("[1, 2]"), "config.json: holds a JSON list, not an object"),
    "no hidden_size": (lambda d: _edit_json(d / "config.json", _drop("hidden_size")), "llama config.json has no hidden_size"),
    "hidden_size a string": (lambda d: _edit_json(d / "config.json", _set("hidden_size", "64")),
                             "hidden_size='64' is not a positive whole number"),
    "no heads": (lambda d: _edit_json(d / "config.json", _set("num_attention_heads", 0)), "num_attention_heads=0 is not"),
    "eps not a number": (lambda d: _edit_json(d / "config.json", _set("rms_norm_eps", "x")), "rms_norm_eps='x' is not a finite"),
    "a billion layers": (lambda d: _edit_json(d / "config.json", _set("num_hidden_layers", 10**9)),
                         "says 1000000000 layers but the weights hold"),
    "header length huge": (lambda d: (d / "model.safetensors").write_bytes(
        (2**60).to_bytes(8, "little") + (d / "model.safetensors").read_bytes()[8:]), "its header claims"),
    "unknown dtype": (lambda d: _damage_header(d, _first_tensor(lambda e: e.update(dtype="F8_E4M3"))),
                      "has dtype 'F8_E4M3', which rayshard cannot import"),
    "shape not numbers": (lambda d: _damage_header(d, _first_tensor(lambda e: e.update(shape=["a"]))),
                          "its shape ['a'] is not a list of whole numbers"),
    "offsets inverted": (lambda d: _damage_header(d, _first_tensor(lambda e: e.update(data_offsets=[8, 0]))),
                         "its data_offsets [8, 0] are not [start, end]"),
    "bytes and shape disagree": (lambda d: _damage_header(d, _first_tensor(lambda e: e.update(shape=[1]))),
                                 "do not hold shape [1] of float32"),
    "rayshard.json a list": (lambda d: (d / "rayshard.json").write_text("[]"), "rayshard.json: holds a JSON list"),
    # Kept with the run and read by every later export: refused at the import, not at each export.
    "tokenizer config a list": (lambda d: (d / "tokenizer_config.json").write_text('["</s>"]'),
                                "tokenizer_config.json: holds a JSON list, not an object"),
    "tokenizer config not JSON": (lambda d: (d / "tokenizer_config.json").write_text('{"eos_token": "</s>",'),
                                  "tokenizer_config.json: is not valid JSON"),
}


@pytest.mark.parametrize("damage", list(DAMAGED_DIRECTORIES))
def test_a_damaged_directory_is_named_and_nothing_is_committed(written, tmp_path, damage):
    url, _, _ = written(False)
    directory = tmp_path / "hf"
    export_hf(url, str(directory), include_optimizer=False, log=lambda *_: None)
    change, fragment = DAMAGED_DIRECTORIES[damage]
    change(directory)
    store = Store(str(tmp_path / "store"))
    with pytest.raises(CheckpointError) as raised:
        import_hf(str(directory), store, "bad", log=lambda *_: None)
    assert fragment in str(raised.value) and "\n" not in str(raised.value)
    assert store.committed_steps("bad") == []
    assert not (tmp_path / "store" / "bad").exists()  # checked before the run's writer lease: no run left behind


def test_an_export_refuses_a_directory_that_holds_files_and_an_import_refuses_two_exports_mixed(written, tmp_path):
    """Stale shards and an old index beside a new export were read back by import as part of it."""
    url, _, _ = written(False)
    sharded, single = tmp_path / "sharded", tmp_path / "single"
    export_hf(url, str(sharded), include_optimizer=False, max_shard_bytes=64 * 1024, log=lambda *_: None)
    with pytest.raises(CheckpointError, match="already holds config.json, model-00001-of-"):
        export_hf(url, str(sharded), include_optimizer=False, log=lambda *_: None)
    export_hf(url, str(single), include_optimizer=False, log=lambda *_: None)
    (sharded / "model.safetensors").write_bytes((single / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="holds both model.safetensors and model.safetensors.index.json"):
        import_hf(str(sharded), Store(str(tmp_path / "store")), "mixed", log=lambda *_: None)


def test_rotary_buffers_of_older_files_are_left_out_and_an_extra_tensor_names_the_directory(written, tmp_path):
    """transformers before 4.31 saved each layer's `rotary_emb.inv_freq` with the weights (derived
    from the config; transformers ignores it on load): the import leaves it out too. A tensor the
    config's model has no place for is refused naming the directory and the tensor."""
    url, _, _ = written(False)
    export_hf(url, str(tmp_path / "hf"), include_optimizer=False, log=lambda *_: None)
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.arange(8.0)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    store = Store(str(tmp_path / "store"))
    imported = import_hf(str(tmp_path / "hf"), store, "old", log=lambda *_: None)
    params = lambda digests: [d for d in digests if d.kind == "param"]  # noqa: E731 - exported without moments
    assert params(digest_checkpoint(imported)) == params(digest_checkpoint(url))
    weights["model.layers.0.mlp.extra.weight"] = torch.ones(2, 2)
    save_file(weights, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"hf \(param\): holds 1 tensor\(s\) the model its config.json describes "
                                              r"has no place for: model.layers.0.mlp.extra.weight") as refused:
        import_hf(str(tmp_path / "hf"), store, "extra", log=lambda *_: None)
    assert "\n" not in str(refused.value) and store.committed_steps("extra") == []
    assert not (tmp_path / "store" / "extra").exists()


def test_a_failed_export_leaves_no_directory_and_a_retry_succeeds(written, tmp_path):
    """The export writes beside --out and renames into it last: an export stopped by a damaged
    shard leaves nothing a reader (or the retry's emptiness check) would find."""
    import shutil

    url, _, store = written(False)
    copy = tmp_path / "copy"
    shutil.copytree(url, copy)
    shard = next(path for path in copy.rglob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's bytes: found by its checksum, after others were written
    shard.write_bytes(bytes(data))
    out = tmp_path / "hf"
    with pytest.raises(CheckpointError, match="checksum"):
        export_hf(str(copy), str(out), log=lambda *_: None)
    assert not out.exists() and not list(tmp_path.glob("hf.partial-*"))
    export_hf(url, str(out), log=lambda *_: None)
    assert (out / "config.json").exists() and not list(tmp_path.glob("hf.partial-*"))
