"""A transformers-made Mixtral (4 experts in every layer, top-2 renormalised, sliding window 8)
imported, trained on fsdp2(ep2) with the losses of one rank within 1e-5, and exported again:
MixtralForCausalLM then computes our logits from the export (fp32, 1e-5), and its loss on the
next tokens is the trained checkpoint's in rayshard within 1e-6 relative."""
from __future__ import annotations

import math

import pytest
import torch
import transformers

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from tests.integration.test_hf_moe_ep_training import _config
from tests.unit.test_hf_families import COMMON, hf_model, ours_from


@pytest.mark.slow  # the default suite's Mixtral case is tests/unit/test_hf_families.py; ep: test_hf_moe_ep_training.py
def test_an_imported_mixtral_trains_with_ep_like_one_rank_and_exports_back(run_training, tmp_path):
    hf_model("mixtral", tied=False).save_pretrained(str(tmp_path / "hf"))
    store = str(tmp_path / "store")
    import_hf(str(tmp_path / "hf"), Store(store), "imported", log=lambda *_: None)

    one = run_training(_config(store, "one", "--dp", "1", "--tp", "1"))
    split = run_training(_config(store, "split", "--dp", "1", "--fsdp", "2", "--ep", "2"))
    assert sorted(split.losses) == [1, 2, 3]
    for step, loss in one.losses.items():
        assert math.isclose(split.losses[step], loss, rel_tol=1e-5), (step, split.losses[step], loss)
    assert split.expert_tokens == one.expert_tokens

    url = Store(store).resolve("split@3").url
    export_hf(url, str(tmp_path / "out"), log=lambda *_: None)
    loaded = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    _, ours = ours_from(url)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, theirs = ours(tokens), loaded(tokens, labels=tokens)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        assert (theirs.logits - logits).abs().max().item() <= 1e-5
    assert abs(loss.item() - theirs.loss.item()) <= 1e-6 * theirs.loss.item()
