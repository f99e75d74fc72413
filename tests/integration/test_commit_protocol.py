"""The commit protocol on S3 (moto) and Azure Blob Storage (Azurite), each through its fault proxy,
a local directory and memory://:
create-only manifests, compare-and-swap LATEST, racing writers, retried conditional writes."""
from __future__ import annotations

import threading
import uuid

import pytest

from rayshard.cluster.catalog.store import Store
from rayshard.plans.errors import CheckpointError


@pytest.fixture(params=["s3", "az", "local", "memory"])
def store_url(request, tmp_path):
    if request.param in ("s3", "az"):
        return request.getfixturevalue(f"{request.param}_store")
    if request.param == "memory":
        return f"memory://commit-{uuid.uuid4().hex[:8]}"
    return str(tmp_path / "store")


def test_commit_creates_the_manifest_then_moves_latest(store_url):
    store = Store(store_url)
    url = store.commit("r", 4, b"manifest-4")
    assert url.endswith("r/checkpoints/step-00000004")
    assert store.committed_steps("r") == [4] and store.latest_step("r") == 4
    store.commit("r", 6, b"manifest-6")
    assert store.committed_steps("r") == [4, 6] and store.latest_step("r") == 6


def test_a_committed_step_is_never_overwritten(store_url):
    store = Store(store_url)
    store.commit("r", 4, b"first")
    with pytest.raises(CheckpointError, match="another writer committed this checkpoint first"):
        store.commit("r", 4, b"second")
    assert store.fs.cat_file(f"{store.root}/r/checkpoints/step-00000004/manifest.parquet") == b"first"
    assert store.latest_step("r") == 4


def test_racing_writers_on_one_step_exactly_one_wins(store_url):
    writers = 6
    barrier, outcomes = threading.Barrier(writers), [None] * writers

    def commit(index: int) -> None:
        store = Store(store_url)
        barrier.wait()
        try:
            store.commit("race", 8, f"writer-{index}".encode())
            outcomes[index] = "won"
        except CheckpointError as error:
            outcomes[index] = str(error)

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert outcomes.count("won") == 1, outcomes
    assert all("another writer" in o for o in outcomes if o != "won")
    store = Store(store_url)
    winner = outcomes.index("won")
    assert store.fs.cat_file(f"{store.root}/race/checkpoints/step-00000008/manifest.parquet") == f"writer-{winner}".encode()
    assert store.latest_step("race") == 8


def test_latest_moved_by_another_writer_during_a_commit_is_a_clear_error(store_url, monkeypatch):
    store, other = Store(store_url), Store(store_url)
    store.commit("r", 2, b"two")
    backend_class = type(store.backend)  # the scheme's own create-only, whichever it is
    real_create_only = backend_class.create_only

    def create_then_lose_the_race(backend, path, data):
        real_create_only(backend, path, data)
        if path.endswith("step-00000004/manifest.parquet"):
            other.commit("r", 6, b"six")  # lands between our manifest and our swap

    monkeypatch.setattr(backend_class, "create_only", create_then_lose_the_race)
    with pytest.raises(CheckpointError, match=r"another writer moved LATEST \(now step 6\)"):
        store.commit("r", 4, b"four")
    assert store.latest_step("r") == 6
    assert store.committed_steps("r") == [2, 4, 6]  # both checkpoints are whole


def test_a_retried_conditional_put_whose_reply_was_lost_still_commits(object_store):
    # The server stores the manifest and LATEST, then the replies are lost: the retries meet
    # their own earlier writes and must not be mistaken for another writer's.
    store, fault_proxy = Store(object_store.url), object_store.proxy
    manifest_rule = fault_proxy.add("reset_after", method="PUT", path=r"manifest\.parquet", times=1)
    latest_rule = fault_proxy.add("reset_after", method="PUT", path=r"/LATEST", times=1)
    store.commit("r", 2, b"two")
    assert manifest_rule.injected == 1 and latest_rule.injected == 1
    assert store.latest_step("r") == 2 and store.committed_steps("r") == [2]


def test_throttling_and_server_errors_are_retried(object_store):
    # One fault per request: each costs one backoff (botocore's jittered exponential, or the
    # Azure SDK's, each growing quickly when a single request fails many times in a row).
    store, fault_proxy = Store(object_store.url), object_store.proxy
    slow = fault_proxy.add("slowdown", method="GET", path="/LATEST", times=1)
    broken = fault_proxy.add("error500", method="PUT", path="manifest", times=1)
    reset = fault_proxy.add("reset", method="PUT", path="/LATEST", times=1)
    store.commit("r", 2, b"two")
    assert store.latest_step("r") == 2
    assert (slow.injected, broken.injected, reset.injected) == (1, 1, 1)


def test_unrecoverable_errors_fail_cleanly_without_credentials_in_the_message(s3_store, fault_proxy, monkeypatch):
    monkeypatch.setenv("RAYSHARD_S3_MAX_ATTEMPTS", "2")
    store = Store(s3_store)
    fault_proxy.add("error500", method="PUT")
    with pytest.raises(OSError, match="We encountered an internal error") as error:
        store.commit("r", 2, b"two")
    # Retried as configured, then given up: two attempts, not botocore's default and not forever.
    assert "reached max retries: 2" in str(error.value.__cause__)
    text = "".join(str(e) for e in (error.value, error.value.__cause__, error.value.__context__))
    assert "testing-secret-do-not-log" not in text and "testing-key-id" not in text
    fault_proxy.clear()
    assert Store(s3_store).committed_steps("r") == []  # nothing visible
