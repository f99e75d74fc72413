"""An imported Hugging Face model of each family trains on dp2 x tp2, resumes on pp2 with its
losses continuing within 1e-5, and exports back to a directory transformers loads."""
from __future__ import annotations

import math

import pytest
import torch

from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.cluster.cli.commands.train import config_from_args
from rayshard.cluster.cli.main import build_parser
from rayshard.cluster.catalog.store import Store
from tests.unit.test_hf_families import COMMON, FAMILIES, hf_model, ours_from


def _config(store: str, run: str, resume: str, steps: int, *layout: str):
    args = build_parser().parse_args(["train", "--store", store, "--run", run, "--resume", resume, "--steps", str(steps),
                                      "--global-batch", "4", "--seq-len", "32", "--ckpt-every", "5", "--seed", "3",
                                      *layout])
    return config_from_args(args)


def loss_on_rayshards_batch(model, config, step: int) -> float:
    """transformers' loss on the global batch rayshard trains on at `step` (counted from 1)."""
    from rayshard.actors.training.data import global_batch, load_corpus

    corpus = load_corpus(config.data.source, config.data.max_bytes)
    inputs, targets = global_batch(corpus, config.seed, step - 1, config.global_batch, config.seq_len)
    with torch.no_grad():
        logits = model(inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


@pytest.mark.parametrize("family", [pytest.param(family, marks=() if family in ("qwen3", "mistral") else pytest.mark.slow)
                                    for family in FAMILIES])
def test_an_imported_family_trains_resumes_across_layouts_and_exports(run_training, tmp_path, family):
    hf_model(family, tied=family == "qwen3").save_pretrained(str(tmp_path / "hf"))
    store = str(tmp_path / "store")
    import_hf(str(tmp_path / "hf"), Store(store), "imported", log=lambda *_: None)

    whole = run_training(_config(store, "whole", "imported@0", 10, "--dp", "2", "--tp", "2"))
    assert whole.losses[10] < whole.losses[1]  # it trains
    piped = run_training(_config(store, "piped", "whole@5", 10, "--dp", "1", "--tp", "1", "--pp", "2"))
    assert sorted(piped.losses) == [6, 7, 8, 9, 10]
    for step, loss in piped.losses.items():
        assert math.isclose(loss, whole.losses[step], rel_tol=1e-5), (step, loss, whole.losses[step])

    url = Store(store).resolve("whole@10").url
    export_hf(url, str(tmp_path / "out"), log=lambda *_: None)
    loaded = type(hf_model(family, tied=False)).from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    _, ours = ours_from(url)
    tokens = torch.randint(0, COMMON["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (loaded(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5
