"""Async saves on S3 and Azure Blob Storage (moto and Azurite, through their fault proxies):
uploads overlap the next steps yet each checkpoint holds exactly the state of its step (the same
checksums as a synchronous save); a failed background upload stops the run at the next step with
an error naming the rank and the object, and LATEST stays on the last good checkpoint."""
from __future__ import annotations

import re
import threading

import pytest

import rayshard.cluster.run.train as train_module

from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.run.train import train
from rayshard.plans.errors import CheckpointError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.integration.test_s3_training import _config

DP2 = ParallelLayout(dp=2)


def _checksums(url: str) -> dict:
    chunks, _ = read_manifest(url)
    return {(c.name, c.kind, c.offsets): c.checksum for c in chunks}


@pytest.fixture(scope="module")
def sync_run(run_training, tmp_path_factory):
    root = tmp_path_factory.mktemp("sync")
    return run_training(_config(root, DP2, steps=3, run="s", ckpt_every=1))


def test_async_checkpoints_hold_their_step_while_training_goes_on(rank_pool, object_store, tmp_path, sync_run,
                                                                   monkeypatch):
    s3_store, fault_proxy = object_store.url, object_store.proxy
    # The shard uploads of step 1 are held at the proxy until the driver has logged step 2: if
    # the save blocked training until its upload finished, step 2 could never run meanwhile and
    # the hold would give up (False below) instead of being released.
    step_2_done, released = threading.Event(), []
    held = fault_proxy.add("delay", method="PUT", path=r"step-00000001/attempt-[0-9a-f]+/rank-0000\d\.safetensors",
                           times=2, callback=lambda *_: released.append(step_2_done.wait(timeout=120)))
    real_log = train_module._log

    def log(message: str) -> None:
        real_log(message)
        if re.match(r"step\s+2/", message):
            step_2_done.set()

    monkeypatch.setattr(train_module, "_log", log)
    result = train(_config(tmp_path, DP2, steps=3, run="a", ckpt_every=1, store=s3_store, async_save=True), rank_pool)
    assert held.injected == 2 and released == [True, True]  # both ranks' step-1 uploads ran across step 2
    assert result.losses == sync_run.losses  # saving in the background changes nothing in training
    store = Store(s3_store)
    assert store.committed_steps("a") == [1, 2, 3] and store.latest_step("a") == 3
    for ours, theirs in zip(result.checkpoints, sync_run.checkpoints, strict=True):
        assert _checksums(ours) == _checksums(theirs)
    chunks, metadata = read_manifest(result.checkpoints[1])
    assert metadata["parent"] == result.checkpoints[0] and metadata["step"] == 2


def test_a_failed_background_upload_is_reported_at_the_next_step(rank_pool, object_store, tmp_path, monkeypatch):
    s3_store, fault_proxy = object_store.url, object_store.proxy
    monkeypatch.setenv("RAYSHARD_S3_MAX_ATTEMPTS", "2")
    broken = fault_proxy.add("error500", method="PUT", path=r"step-00000002/attempt-[0-9a-f]+/rank-00001")
    with pytest.raises(CheckpointError) as error:
        train(_config(tmp_path, DP2, steps=4, run="b", ckpt_every=2, store=s3_store, async_save=True), rank_pool)
    message = str(error.value)
    assert "checkpoint step 2" in message and "rank 1" in message and "rank-00001.safetensors" in message
    assert "no committed checkpoint yet" in message
    assert broken.injected
    fault_proxy.clear()
    store = Store(s3_store)
    assert store.committed_steps("b") == [] and store.latest_step("b") is None
    # Now with a good checkpoint before the failure: LATEST stays on it.
    fault_proxy.add("error500", method="PUT", path=r"step-00000004/attempt-[0-9a-f]+/rank-00000")
    with pytest.raises(CheckpointError, match="LATEST still names step 2"):
        train(_config(tmp_path, DP2, steps=6, run="c", ckpt_every=2, store=s3_store, async_save=True), rank_pool)
    assert store.committed_steps("c") == [2] and store.latest_step("c") == 2
