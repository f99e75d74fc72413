"""Training with the store on the S3 test server (and, where a test takes `object_store`, on Azurite
too): rank actors write and read their shards through the fault proxy, resume onto another layout,
and survive throttling, resets and delays bit-exact."""
from __future__ import annotations

import pytest

from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.catalog.store import Store
from rayshard.plans.config import ModelChoice, OptimizerConfig
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config

DP2_TP2 = ParallelLayout(dp=2, tp=2)


def _config(root, layout, **overrides):
    # A fixed schedule length, so a resumed run follows the uninterrupted run's schedule.
    optimizer = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, decay_steps=8)
    return small_config(root, layout, optimizer=optimizer, **overrides)


def _checksums(checkpoint_url: str) -> dict:
    chunks, _ = read_manifest(checkpoint_url)
    return {(c.name, c.kind, c.offsets): c.checksum for c in chunks}


@pytest.fixture(scope="module")
def local_reference(run_training, tmp_path_factory):
    """The same training with a local store and no faults: 3 steps, checkpoints at 2 and 3."""
    root = tmp_path_factory.mktemp("reference")
    result = run_training(_config(root, DP2_TP2, steps=3, run="ref", ckpt_every=2))
    return result


def test_an_object_store_saves_and_resumes_onto_another_layout(run_training, object_store, tmp_path, local_reference):
    s3_store = object_store.url
    run_training(_config(tmp_path, DP2_TP2, steps=2, run="x", store=s3_store))
    store = Store(s3_store)
    assert store.committed_steps("x") == [2] and store.latest_step("x") == 2
    assert _checksums(store.resolve("x").url) == _checksums(local_reference.checkpoints[0])
    resumed = run_training(_config(tmp_path, ParallelLayout(fsdp=2), steps=3, run="x", resume="x@2", store=s3_store))
    assert resumed.losses[3] == pytest.approx(local_reference.losses[3], rel=1e-5)
    assert store.latest_step("x") == 3


@pytest.mark.slow  # decision 153: the store's retries are test_s3_streaming's and test_commit_protocol's
def test_saves_and_loads_survive_throttling_resets_and_delays_bit_exact(run_training, object_store, tmp_path,
                                                                         local_reference):
    s3_store, fault_proxy = object_store.url, object_store.proxy
    rules = [fault_proxy.add("slowdown", method="PUT", path=r"rank-0000[02]\.safetensors", times=2),
             fault_proxy.add("reset", method="PUT", path=r"rank-00001\.safetensors", times=1),
             fault_proxy.add("error500", method="PUT", path=r"rank-00003\.safetensors", times=1),
             fault_proxy.add("delay", method="PUT", path="manifest", times=1, seconds=0.5)]
    run_training(_config(tmp_path, DP2_TP2, steps=2, run="f", store=s3_store))
    store = Store(s3_store)
    assert _checksums(store.resolve("f").url) == _checksums(local_reference.checkpoints[0])
    assert all(rule.injected for rule in rules), [(r.fault, r.injected) for r in rules]

    fault_proxy.clear()
    reads = [fault_proxy.add("slowdown", method="GET", path=r"rank-00000\.safetensors", times=2),
             fault_proxy.add("reset", method="GET", path=r"rank-00002\.safetensors", times=1),
             fault_proxy.add("delay", method="GET", path=r"rank-00003\.safetensors", times=2, seconds=0.3)]
    resumed = run_training(_config(tmp_path, DP2_TP2, steps=3, run="f", resume="latest", store=s3_store))
    assert resumed.losses[3] == local_reference.losses[3]  # bit for bit
    assert all(rule.injected for rule in reads), [(r.fault, r.injected) for r in reads]


def test_offline_reshard_on_an_object_store_keeps_digests(run_training, object_store, tmp_path):
    """The default suite's offline reshard on S3 and Azurite: a one-layer model (few chunks: every
    chunk is a request to a test server), dp2 -> tp2 in the driver, reading and writing through it."""
    s3_store = object_store.url
    from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint
    from tests.integration.reshard_helpers import digests

    one_layer = ModelChoice.named("tiny", n_layers=1)
    source = run_training(_config(tmp_path, ParallelLayout(dp=2), steps=1, run="small", store=s3_store,
                                  model=one_layer)).checkpoints[-1]
    store = Store(s3_store)
    result = reshard_checkpoint(source, ParallelLayout(tp=2), store, "small-tp2", local=True, log=lambda *_: None)
    assert result.url.startswith(f"{object_store.kind}://") and store.latest_step("small-tp2") == 1
    assert digests(result.url) == digests(source)
    chunks, metadata = read_manifest(result.url)
    assert metadata["layout"] == ParallelLayout(tp=2).to_dict()
    assert {c.file.rsplit("/", 1)[-1] for c in chunks} == {"rank-00000.safetensors", "rank-00001.safetensors"}


# Slow: every chunk is a request to a test server (~800 for the tiny model); the default
# suite's S3 reshard coverage is the resume onto another layout and the one-layer reshard above.
@pytest.mark.slow
@pytest.mark.parametrize("workers", [pytest.param(None, id="in-driver"), pytest.param(3, id="ray-workers")])
def test_reshard_on_an_object_store_keeps_digests_and_round_trips_bit_exact(run_training, object_store, tmp_path,
                                                                             ray_session, workers):
    """The resharding e2e with the store on the S3 server or Azurite: A -> B keeps digests,
    A -> B -> A is A bit for bit; with Ray workers, they reach the store with the driver's
    shipped options."""
    from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint
    from tests.integration.reshard_helpers import chunk_fingerprint, digests

    s3_store = object_store.url
    source = run_training(_config(tmp_path, DP2_TP2, steps=2, run="src", store=s3_store)).checkpoints[-1]
    store = Store(s3_store)
    where = {"local": True} if workers is None else {"workers": workers, "num_cpus": 0}
    there = reshard_checkpoint(source, ParallelLayout(fsdp=3, tp=2), store, "fsdp3-tp2", log=lambda *_: None, **where).url
    assert there.startswith(f"{object_store.kind}://") and digests(there) == digests(source)
    back = reshard_checkpoint(there, DP2_TP2, store, "back", local=True, log=lambda *_: None).url
    assert chunk_fingerprint(back) == chunk_fingerprint(source)
