"""Crash tests on S3 and on Azure Blob Storage (moto and Azurite, each through its fault proxy): a rank actor or the driver dies at a chosen point of a save — before any
shard, between shards, before the manifest, between the manifest and LATEST. The fault proxy
sees the storage protocol, so it pulls the trigger on the exact request. Afterwards the catalog
shows only whole checkpoints, LATEST loads with unchanged checksums, and gc removes the leftovers.

The dying processes are never the session's pooled actors: rank kills use fresh actors, driver
kills a driver subprocess with its own actors.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.catalog.catalog import Catalog
from rayshard.cluster.catalog.retention import collect
from rayshard.cluster.checkpoint.verify import verify
from rayshard.cluster.catalog.store import Store
from rayshard.plans.errors import StepFailed
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.integration.test_s3_training import _config
from tests.s3_fixtures import TEST_STORAGE_ENV

FSDP2 = ParallelLayout(fsdp=2)
SHARD = r"rank-0000\d\.safetensors"

# point -> (request that triggers the crash, whether the step-3 checkpoint is whole afterwards)
POINTS = {
    "before shards": (("PUT", SHARD), False),
    "between shards": (("PUT", r"rank-00001\.safetensors"), False),
    "before the manifest": (("PUT", r"manifest\.parquet"), False),
    "between manifest and LATEST": (("PUT", r"/LATEST"), True),
}


def _checksums(url: str) -> dict:
    chunks, _ = read_manifest(url)
    return {(c.name, c.kind, c.offsets): c.checksum for c in chunks}


@pytest.fixture
def committed_step_2(run_training, object_store, tmp_path):
    """Run 'c' on the object store with LATEST at step 2, and the checksums of that checkpoint."""
    s3_store = object_store.url
    run_training(_config(tmp_path, FSDP2, steps=2, run="c", store=s3_store))
    store = Store(s3_store)
    return store, _checksums(store.resolve("c").url)


def _check_recovered(store: Store, before: dict, step_3_whole: bool) -> None:
    catalog = Catalog(store)
    entries = catalog.checkpoints("c")
    assert all(e.whole for e in entries), [(e.step, e.status) for e in entries]
    assert [e.step for e in entries] == ([2, 3] if step_3_whole else [2])
    assert store.latest_step("c") == 2
    latest = store.resolve("latest", current_run="c").url
    assert _checksums(latest) == before and verify(latest, deep=True).ok
    report = collect(store, keep=5, grace_s=0)
    assert catalog.leftovers("c") == [] and store.latest_step("c") == 2
    return report


def _driver(ray_session, store_url: str, proxy_url: str, **spec) -> subprocess.Popen:
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address, AWS_ENDPOINT_URL=proxy_url,
               **TEST_STORAGE_ENV)
    spec = dict(store=store_url, layout={"fsdp": 2}, **spec)
    return subprocess.Popen([sys.executable, "-m", "tests.integration.crash_driver", json.dumps(spec)], env=env,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


# Default run: one point each for driver and rank deaths (a subprocess driver costs ~10 s); the
# rest with -m slow.
DRIVER_POINTS = [pytest.param(p, marks=[] if p == "between manifest and LATEST" else pytest.mark.slow) for p in POINTS]


@pytest.mark.parametrize("point", DRIVER_POINTS)
def test_driver_killed_during_a_save_leaves_only_whole_checkpoints(point, ray_session, committed_step_2, object_store,
                                                                    run_training, tmp_path):
    s3_store, fault_proxy = object_store.url, object_store.proxy
    store, before = committed_step_2
    (method, path), step_3_whole = POINTS[point]
    driver = _driver(ray_session, s3_store, fault_proxy.url, run="c", steps=3, resume="latest")
    rule = fault_proxy.add("reset", method=method, path=path, times=1,
                           callback=lambda *_: os.kill(driver.pid, signal.SIGKILL))
    _, stderr = driver.communicate(timeout=240)
    assert driver.returncode == -signal.SIGKILL, stderr.decode()[-3000:]
    assert rule.injected == 1
    fault_proxy.clear()
    report = _check_recovered(store, before, step_3_whole)
    if point in ("between shards", "before the manifest"):
        assert report.removed_leftovers  # the dead save's shards
    # Resubmitted as an operator would (--resume latest, the dead driver's writer lease still in
    # the store): step 3, whole but not named by LATEST, is adopted, not retrained into a clash.
    resumed = run_training(_config(tmp_path, FSDP2, steps=4, run="c", resume="latest", store=s3_store))
    assert resumed.start_step == (3 if step_3_whole else 2) and store.latest_step("c") == 4
    assert store.committed_steps("c") == ([2, 3, 4] if step_3_whole else [2, 4])


# Default run: one point of each commit phase: shards being written (a rank, between shards), every
# shard stored but no manifest (a rank, before the manifest), manifest stored but not LATEST (the
# driver, above); the rest with -m slow.
RANK_POINTS = [pytest.param(p, marks=[] if p == "before the manifest" else pytest.mark.slow)  # decision 153
               for p in ("before shards", "between shards", "before the manifest")]


@pytest.mark.parametrize("point", RANK_POINTS)
def test_rank_killed_during_a_save_leaves_only_whole_checkpoints(point, ray_session, run_training, committed_step_2,
                                                                  object_store, tmp_path):
    s3_store, fault_proxy = object_store.url, object_store.proxy
    from rayshard.actors.rank import RankActor
    from rayshard.cluster.run.train import train

    store, before = committed_step_2
    fresh = [RankActor.options(num_cpus=0).remote() for _ in range(2)]
    victim = fresh[1]
    kill = lambda *_: ray_session.kill(victim)  # noqa: E731
    if point == "before shards":  # rank 1 dies at its first write; nobody's write gets through
        fault_proxy.add("reset", method="PUT", path=r"rank-00001\.safetensors", callback=kill, times=1)
        fault_proxy.add("reset", method="PUT", path=SHARD)
    elif point == "between shards":  # rank 0's shard is stored, rank 1 dies writing its own
        fault_proxy.add("reset", method="PUT", path=r"rank-00001\.safetensors", callback=kill, times=1)
    else:  # every shard stored: rank 1 dies before the driver gets its answer
        fault_proxy.add("delay", method="PUT", path=r"rank-00001\.safetensors", callback=kill, times=1)
    try:
        with pytest.raises(StepFailed, match=r"^save_shard failed on \d rank\(s\):") as failed:
            train(_config(tmp_path, FSDP2, steps=3, run="c", resume="latest", store=s3_store), fresh)
        assert failed.value.dead_ranks == [1] and "rank 1: " in str(failed.value), str(failed.value)
    finally:
        for actor in fresh:
            ray_session.kill(actor)
    fault_proxy.clear()
    _check_recovered(store, before, step_3_whole=False)
    # LATEST loads: the pool resumes from it and commits step 3.
    resumed = run_training(_config(tmp_path, FSDP2, steps=3, run="c", resume="latest", store=s3_store))
    assert resumed.start_step == 2 and store.latest_step("c") == 3
