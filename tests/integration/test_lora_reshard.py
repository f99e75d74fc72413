"""`ckpt reshard` and `ckpt plan` on an adapter checkpoint (docs/decisions.md 140's planning view):
the planners see the adapters alone, split under tp as the trainer splits them and cut into
pipeline stages with their layers. A LoRA checkpoint written on tp2 resharded offline to pp2 x tp2
and to fsdp2 keeps every tensor's digest, back on tp2 it is the same chunks, and the copy resumes."""
from __future__ import annotations

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint
from rayshard.cluster.checkpoint.reshard_report import build_plan
from rayshard.plans.config import LoraConfig
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.storage.manifest_io import read_manifest
from tests.conftest import small_config
from tests.integration.reshard_helpers import chunk_fingerprint, digests

SOURCE = ParallelLayout(tp=2)


def test_an_adapter_checkpoint_reshards_bit_exact_plans_and_resumes(run_training, tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0)
    config = lambda layout, run, **extra: small_config(tmp_path, layout, global_batch=8, seq_len=16, run=run, lora=lora,
                                                       **{"steps": 2, **extra})
    url = run_training(config(SOURCE, "src")).checkpoints[-1]
    store = Store(str(tmp_path / "store"))
    source = digests(url)
    assert source and all(".lora." in name for name, _ in source)
    for name, layout in (("pptp", ParallelLayout(pp=2, tp=2)), ("fsdp", ParallelLayout(fsdp=2))):
        chunks, metadata = read_manifest(url)
        plan, _ = build_plan(chunks, metadata, layout)  # `ckpt plan`: proves coverage of every target piece
        assert set(plan.tensors) == set(source)  # the adapters and their moments, nothing of the base
        there = reshard_checkpoint(url, layout, store, f"to-{name}", local=True, log=lambda *_: None).url
        assert digests(there) == source
        back = reshard_checkpoint(there, SOURCE, store, f"back-{name}", local=True, log=lambda *_: None).url
        assert chunk_fingerprint(back) == chunk_fingerprint(url)
    # The copy on pp2 x tp2 is a checkpoint of the run's adapters: training resumes from it there.
    resumed = run_training(config(ParallelLayout(pp=2, tp=2), "to-pptp", steps=3, resume="latest"))
    assert resumed.start_step == 2 and sorted(resumed.losses) == [3]
