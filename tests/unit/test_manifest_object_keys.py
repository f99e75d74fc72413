"""A manifest naming objects outside its checkpoint (`..`, an absolute path, another bucket) is
refused on every path that opens a checkpoint by URL — digest, verify, export, a rank's load and
the CLI — before any shard byte is read, with an error naming the key and the checkpoint."""
import re
from dataclasses import replace

import pytest

from rayshard.plans.checkpoint.manifest.codec import encode_manifest
from rayshard.actors.checkpoint.load import load_rank_shard
from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.cli.main import main
from rayshard.cluster.checkpoint.digest import digest_checkpoint
from rayshard.cluster.checkpoint.hf_interop import export_hf
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.verify import verify
from rayshard.plans.errors import CheckpointError
from rayshard.plans.training.model_spec import preset
from tests.unit.checkpoint_factory import trained_model, write_checkpoint


@pytest.fixture(scope="module")
def evil(tmp_path_factory):
    """{key: URL of a committed checkpoint whose every chunk names that key as its file}."""
    root = tmp_path_factory.mktemp("keys") / "store"
    real, _, _ = write_checkpoint(str(root), "victim", preset("tiny"))
    chunks, metadata = read_manifest(real)
    [shard] = {c.file for c in chunks}
    keys = [f"../../../victim/checkpoints/step-00000002/{shard}",  # the victim's real shard: readable without the check
            f"{real}/{shard}",  # an absolute path
            "s3://other-bucket/x.safetensors"]
    store, urls = Store(str(root)), {}
    for number, key in enumerate(keys):
        run = f"evil-{number}"
        urls[key] = store.commit(run, 2, encode_manifest([replace(c, file=key) for c in chunks], dict(metadata, run=run)))
    return urls


def _refused(key: str, url: str):
    return pytest.raises(CheckpointError, match="^" + re.escape(f"{url}: manifest names object {key!r}, which is outside the checkpoint"))


@pytest.mark.parametrize("index", [0, 1, 2], ids=["dotdot", "absolute", "other-bucket"])
def test_every_reader_refuses_keys_outside_the_checkpoint(evil, index, tmp_path):
    key, url = list(evil.items())[index]
    with _refused(key, url):
        digest_checkpoint(url)
    with _refused(key, url):
        verify(url, deep=True)
    with _refused(key, url):
        export_hf(url, str(tmp_path / "hf"), log=lambda *_: None)
    assert not (tmp_path / "hf").exists()  # refused before anything was written either
    model, optimizer = trained_model(preset("tiny"), steps=0)
    with _refused(key, url):
        load_rank_shard(model, optimizer, url, {name for name, _ in model.named_parameters()})


def test_the_cli_names_the_key_and_the_checkpoint(evil, capsys):
    key, url = next(iter(evil.items()))
    for command in (["digest", url], ["verify", url, "--deep"], ["export", url, "--out", "/nonexistent/hf"]):
        assert main(["ckpt", *command]) == 2
        err = capsys.readouterr().err
        assert f"{url}: manifest names object '{key}'" in err and "outside the checkpoint directory" in err
