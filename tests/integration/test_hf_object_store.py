"""Hugging Face export and import through an object store, on each backend (S3 on moto, Azure Blob
Storage on Azurite, both behind the fault proxy): `ckpt export RUN@STEP --out <store URL>` writes
the directory as objects, `ckpt import <store URL>` reads it back into a checkpoint of the same
store, and the import holds the checkpoint's training state digest for digest.

Sharded (an index and several weight files) so the import reads an index and more than one file,
and a throttled PUT and a 500 on a GET are retried on the way."""
from __future__ import annotations

import fsspec
import pytest

from rayshard.cluster.checkpoint.digest import digest_checkpoint
from rayshard.cluster.cli.main import main
from rayshard.plans.training.model_spec import preset
from tests.unit.checkpoint_factory import write_checkpoint


@pytest.mark.slow  # decision 153: the store's streaming is test_s3_streaming's, the export's bits the local tests'
def test_export_to_the_store_and_import_back_is_bit_exact(object_store):
    source, _, _ = write_checkpoint(object_store.url, "src", preset("tiny"), steps=2)
    hf = f"{object_store.url.rsplit('/', 1)[0]}/exports/src-2"  # beside the store, in the same bucket
    object_store.proxy.add("slowdown", method="PUT", path=r"/exports/src-2/model-", times=1)
    object_store.proxy.add("error500", method="GET", path=r"/exports/src-2/model-", times=1)

    assert main(["ckpt", "export", "src@2", "--store", object_store.url, "--out", hf, "--max-shard-mib", "0.25",
                 "--quiet"]) == 0
    fs, base = fsspec.core.url_to_fs(hf)
    written = {path.rsplit("/", 1)[-1] for path in fs.find(base)}
    assert {"config.json", "model.safetensors.index.json", "rayshard.json"} <= written
    assert len([name for name in written if name.startswith("model-")]) > 1

    assert main(["ckpt", "import", hf, "--run", "imported", "--store", object_store.url, "--quiet"]) == 0
    imported = f"{object_store.url}/imported/checkpoints/step-00000002"
    assert digest_checkpoint(imported) == digest_checkpoint(source)
    assert all(rule.injected == 1 for rule in object_store.proxy.rules)  # the faults did land, and were retried
