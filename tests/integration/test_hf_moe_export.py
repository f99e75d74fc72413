"""moe-tiny trained by rayshard (one rank, and fsdp2 with the experts split over ep2) exports to a
directory Qwen2MoeForCausalLM loads and computes our logits from (fp32, 1e-5), and the import of
that export is the trained checkpoint, digest for digest (weights and AdamW moments).

The checkpoint is layout-free (experts stored stacked under their global index whichever rank
held them), so the ep-written one exports by the same mapping; this checks that end to end."""
from __future__ import annotations

import pytest
import torch
import transformers

from rayshard.cluster.checkpoint.digest import digest_checkpoint
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.cluster.catalog.store import Store
from rayshard.plans.config import ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import preset
from tests.conftest import small_config
from tests.unit.test_hf_families import ours_from

LAYOUTS = {"one-rank": ParallelLayout(), "fsdp2(ep2)": ParallelLayout(fsdp=2, ep=2)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_trained_moe_exports_to_qwen2_moe_and_imports_back_bit_exact(run_training, tmp_path, name):
    config = small_config(tmp_path, LAYOUTS[name], model=ModelChoice(spec=preset("moe-tiny")), steps=3, global_batch=4,
                          seq_len=16, run="moe")
    run_training(config)
    url = Store(config.store).resolve("moe@3").url
    export_hf(url, str(tmp_path / "hf"), log=lambda *_: None)

    loaded = transformers.Qwen2MoeForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    _, ours = ours_from(url)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        difference = (loaded(tokens).logits - ours(tokens)).abs().max().item()
    assert difference <= 1e-5, difference

    imported = import_hf(str(tmp_path / "hf"), Store(config.store), "imported", log=lambda *_: None)
    assert digest_checkpoint(imported) == digest_checkpoint(url)
