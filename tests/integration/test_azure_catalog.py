"""The catalog's checks of test_catalog_gc.py, run on Azure Blob Storage (Azurite through its fault
proxy): ls, verify (a flipped byte named by --deep), gc of an aborted attempt and of what LATEST
and leases do not protect; and gc of the uncommitted blocks a dead writer left, Azure's pending
uploads. No Ray: checkpoints are written by the same shard writer the ranks use."""
from __future__ import annotations

import uuid

import pytest
import torch

import rayshard.checkpoint as ckpt
from rayshard.cluster.catalog.retention import collect
from rayshard.cluster.cli.main import main
from rayshard.plans.errors import StoreUnavailable
from rayshard.cluster.catalog.store import Store
from tests.integration.test_catalog_gc import (  # noqa: F401 (collected here, on this module's `store`)
    test_catalog_is_a_pyarrow_dataset, test_gc_keeps_latest_leased_and_young_things,
    test_gc_keeps_the_newest_checkpoint_when_latest_is_missing_or_damaged,
    test_ls_shows_whole_checkpoints_and_leftovers_separately, test_verify_finds_missing_truncated_and_corrupted_shards,
    write_checkpoint)


@pytest.fixture
def store(az_store):
    return Store(az_store)


def test_gc_discards_the_uncommitted_blocks_a_dead_writer_left(store):
    from azure.storage.blob import BlobServiceClient
    import os

    write_checkpoint(store, "r", 1)
    container, prefix = store.url.removeprefix("az://").split("/", 1)
    with BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"]) as service:
        ours = service.get_blob_client(container, f"{prefix}/r/checkpoints/step-00000002/attempt-x/rank-00000.safetensors")
        ours.stage_block("00000001", b"a part of a shard")  # Put Block, then the writer died
        other = service.get_blob_client(container, "elsewhere/not-ours")
        other.stage_block("00000001", b"another tool's upload")
        [pending] = store.backend.pending_uploads(store.root)
        young = collect(store, keep=1, now=pending.initiated_unix + 60)
        assert not young.aborted_uploads and any("multipart upload" in why for _, why in young.kept)
        report = collect(store, keep=1, grace_s=0)
        assert [p.rsplit("/", 1)[-1] for p in report.aborted_uploads] == ["rank-00000.safetensors"]
        assert store.backend.pending_uploads(store.root) == [] and not ours.exists()
        assert [u.path for u in store.backend.pending_uploads(container)] == [f"{container}/elsewhere/not-ours"]
    assert store.committed_steps("r") == [1]


@pytest.mark.slow  # decision 113: ls, gc and verify on Azure stay in the default suite
def test_show_diff_and_digest_read_an_azure_catalog(az_store, capsys):
    """The catalog's reading commands through the CLI on az://: show, diff (two steps differ:
    exit 1, naming tensors), digest (layout-independent, so the same for the same step)."""
    from rayshard.cluster.cli.main import main
    from rayshard.plans.training.model_spec import preset
    from tests.unit.checkpoint_factory import write_checkpoint as write_trained

    write_trained(az_store, "r", preset("tiny"), steps=1)
    write_trained(az_store, "r", preset("tiny"), steps=2)
    assert main(["ckpt", "show", "r@1", "--store", az_store]) == 0
    assert "step" in capsys.readouterr().out
    assert main(["ckpt", "diff", "r@1", "r@2", "--store", az_store]) == 1
    assert "layers.0" in capsys.readouterr().out
    assert main(["ckpt", "digest", "r@2", "--store", az_store]) == 0
    first = capsys.readouterr().out.strip().splitlines()[-1]
    assert main(["ckpt", "digest", "r@2", "--store", az_store]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == first and first


@pytest.mark.parametrize("scheme", ["az", "s3"])
def test_a_store_whose_container_does_not_exist_is_named_not_blamed_on_another_writer(scheme, request, capsys):
    """Azure's missing container went unseen (`ckpt ls` listed nothing, exit 0), and a save into a
    missing bucket or container read the store's not-found as a lost compare-and-swap: "another
    trainer is starting on it". Both now name the container, and nothing creates it."""
    live = request.getfixturevalue("az_store" if scheme == "az" else "s3_store")
    missing = f"{scheme}://rayshard-missing-{uuid.uuid4().hex[:12]}/store"
    capsys.readouterr()
    for argv in (["ckpt", "ls", "--store", missing], ["ckpt", "verify", "r1", "--store", missing]):
        assert main(argv) == 3, argv  # verify said "run 'r1' has no committed checkpoint"
        said = capsys.readouterr().err.strip()
        assert "does not exist" in said and "\n" not in said, said
    with pytest.raises(StoreUnavailable, match=r"its bucket \(container\) 'rayshard-missing-.*' does not exist"):
        ckpt.save({"w": torch.arange(4.0)}, f"{missing}/r1", step=1)
    assert Store(live).backend.missing_container(missing.split("://", 1)[1]) is not None  # still not made
