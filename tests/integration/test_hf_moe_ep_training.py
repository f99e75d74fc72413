"""A transformers-made Qwen2-MoE (4 experts, sizes no preset has) imported, trained on
fsdp2(ep2) x tp2 with the losses of one rank, and exported again: transformers then computes
our logits from the export (fp32, 1e-5). This is the path of a user fine-tuning a Hub MoE model
with its experts split over ranks."""
from __future__ import annotations

import math

import torch
import transformers

from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.cluster.cli.commands.train import config_from_args
from rayshard.cluster.cli.main import build_parser
from rayshard.cluster.catalog.store import Store
from tests.unit.test_hf_families import ours_from
from tests.unit.test_hf_moe import _hf_moe


def _config(store: str, run: str, *layout: str):
    args = build_parser().parse_args(["train", "--store", store, "--run", run, "--resume", "imported@0", "--steps", "3",
                                      "--global-batch", "4", "--seq-len", "16", "--seed", "3", *layout])
    return config_from_args(args)


def test_an_imported_moe_trains_with_ep_like_one_rank_and_exports_back(run_training, tmp_path):
    _hf_moe("qwen2_moe").save_pretrained(str(tmp_path / "hf"))
    store = str(tmp_path / "store")
    import_hf(str(tmp_path / "hf"), Store(store), "imported", log=lambda *_: None)

    one = run_training(_config(store, "one", "--dp", "1", "--tp", "1"))
    split = run_training(_config(store, "split", "--dp", "1", "--fsdp", "2", "--ep", "2", "--tp", "2"))
    assert sorted(split.losses) == [1, 2, 3]
    for step, loss in one.losses.items():
        assert math.isclose(split.losses[step], loss, rel_tol=1e-5), (step, split.losses[step], loss)
    assert split.expert_tokens == one.expert_tokens

    url = Store(store).resolve("split@3").url
    export_hf(url, str(tmp_path / "out"), log=lambda *_: None)
    loaded = transformers.Qwen2MoeForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    _, ours = ours_from(url)
    tokens = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (loaded(tokens).logits - ours(tokens)).abs().max().item() <= 1e-5
