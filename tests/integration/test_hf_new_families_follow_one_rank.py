"""Issue 42's acceptance, per family it added before Gemma (Phi-3, Mixtral) and per RoPE scaling
type of Llama (linear, dynamic, yarn, llama3): a random transformers model of odd size, imported,
whose first loss is transformers' on the same batch (1e-6 relative, fp32); dp2 x tp2 and pp2 follow
one rank within 1e-5 for 10 steps; and the export of the dp2 x tp2 run reproduces, in
transformers, rayshard's next loss (step 11, one rank resumed from it). Gemma's own cases are in
test_hf_gemma_training.py, GPT-2's in test_hf_gpt2_training.py, Mixtral's fsdp2(ep2) in
test_hf_mixtral_ep_training.py."""
from __future__ import annotations

import math

import pytest
import torch

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from tests.integration.test_hf_family_training import _config, loss_on_rayshards_batch
from tests.unit.test_hf_families import hf_model
from tests.unit.test_hf_rope_scaling import SCALINGS, hf_llama

STEPS = 10
ONE_RANK = ("--dp", "1", "--tp", "1")
CASES = {
    "phi3": lambda: hf_model("phi3", tied=False),
    "mixtral": lambda: hf_model("mixtral", tied=False),
    **{f"llama-{kind}": (lambda kind=kind: hf_llama(SCALINGS[kind], vocab_size=1001))
       for kind in ("linear", "dynamic", "yarn", "llama3")},
}


def _follows(run, reference):
    assert sorted(run.losses) == list(range(1, STEPS + 1))
    for step, loss in run.losses.items():
        assert math.isclose(loss, reference.losses[step], rel_tol=1e-5), (step, loss, reference.losses[step])


@pytest.mark.slow  # six cases of four short runs each: minutes on 2 cores
@pytest.mark.parametrize("case", list(CASES))
def test_follows_one_rank_on_dp2_tp2_and_pp2_and_the_export_reproduces_the_next_loss(run_training, tmp_path, case):
    made = CASES[case]()
    made.save_pretrained(str(tmp_path / "hf"))
    store = str(tmp_path / "store")
    import_hf(str(tmp_path / "hf"), Store(store), "imported", log=lambda *_: None)

    first = _config(store, "one", "imported@0", STEPS, *ONE_RANK)
    one = run_training(first)
    assert one.losses[STEPS] < one.losses[1]  # it trains
    theirs = loss_on_rayshards_batch(made.eval(), first, 1)
    assert abs(one.losses[1] - theirs) <= 1e-6 * theirs, (one.losses[1], theirs)
    _follows(run_training(_config(store, "split", "imported@0", STEPS, "--dp", "2", "--tp", "2")), one)
    _follows(run_training(_config(store, "piped", "imported@0", STEPS, *ONE_RANK, "--pp", "2", "--microbatches", "2")),
             one)

    export_hf(Store(store).resolve(f"split@{STEPS}").url, str(tmp_path / "out"), include_optimizer=False,
              log=lambda *_: None)
    loaded = type(made).from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    following = _config(store, "next", f"split@{STEPS}", STEPS + 1, *ONE_RANK)
    ours_next = run_training(following).losses[STEPS + 1]
    theirs_next = loss_on_rayshards_batch(loaded, following, STEPS + 1)
    assert abs(ours_next - theirs_next) <= 1e-6 * theirs_next, (ours_next, theirs_next)
