"""A Llama 3.1-style model (llama3 RoPE scaling) imported from transformers trains on dp2 x tp2
following one rank within 1e-5, on sequences longer than its original context, so the scaled
tables are the ones every rank uses; the trained export keeps the scaling and the special tokens
and computes rayshard's logits in transformers. (Vocabulary 1000 was chosen when tp had to divide it;
since decision 118 any vocabulary trains on tp.)"""
from __future__ import annotations

import json
import math

import torch
import transformers

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from tests.integration.test_hf_family_training import _config
from tests.unit.test_hf_families import ours_from
from tests.unit.test_hf_rope_scaling import SCALINGS, _assert_computes_transformers, hf_llama

STEPS = 4


def test_llama3_scaling_trains_on_dp2_tp2_as_on_one_rank(run_training, tmp_path):
    hf_llama(SCALINGS["llama3"], vocab_size=1000).save_pretrained(str(tmp_path / "hf"))
    store = str(tmp_path / "store")
    import_hf(str(tmp_path / "hf"), Store(store), "imported", log=lambda *_: None)

    config = _config(store, "one", "imported@0", STEPS, "--dp", "1", "--tp", "1")
    assert config.model.spec.rope_scaling.rope_type == "llama3" and config.seq_len > 16  # the resume's own model
    one = run_training(config)
    split = run_training(_config(store, "split", "imported@0", STEPS, "--dp", "2", "--tp", "2"))
    assert sorted(split.losses) == sorted(one.losses) == list(range(1, STEPS + 1))
    for step, loss in split.losses.items():
        assert math.isclose(loss, one.losses[step], rel_tol=1e-5), (step, loss, one.losses[step])

    url = Store(store).resolve(f"split@{STEPS}").url
    export_hf(url, str(tmp_path / "out"), include_optimizer=False, log=lambda *_: None)
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    assert exported["rope_parameters"]["rope_type"] == "llama3"
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (1, 2)  # LlamaConfig's, kept through training
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    _assert_computes_transformers(ours_from(url)[1], loaded, 1000)
