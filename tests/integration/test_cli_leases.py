"""Every CLI command that reads a checkpoint's shards holds a reader lease while it reads, so a
`ckpt gc` that runs in the middle of the read keeps the checkpoint.

The read is paused on S3 (moto behind the fault proxy): the proxy holds the command's first shard
GET and, while holding it, runs gc. Nothing of the command is mocked."""
from __future__ import annotations

import threading

import pytest

from rayshard.cluster.cli.main import main
from rayshard.cluster.catalog.retention import collect
from rayshard.cluster.catalog.store import Store
from rayshard.plans.training.model_spec import preset
from tests.unit.checkpoint_factory import write_checkpoint

COMMANDS = {
    "digest": ["digest", "r@1"],
    "diff": ["diff", "r@1", "r@2"],
    "export": ["export", "r@1", "--out", "{tmp}/hf"],
    "reshard": ["reshard", "r@1", "--to", "tp=2", "--run", "copy", "--local"],
    "verify": ["verify", "r@1", "--deep", "--quiet"],
}


# Every command takes its reader lease through the same call; two in the default suite (decision 113).
@pytest.mark.parametrize("command", [c if c in ("digest", "reshard") else pytest.param(c, marks=pytest.mark.slow)
                                     for c in COMMANDS])
def test_gc_keeps_a_checkpoint_while_a_command_reads_it(command, s3_store, fault_proxy, monkeypatch, tmp_path):
    monkeypatch.setenv("RAYSHARD_S3_READ_TIMEOUT_S", "60")  # the held GET must not time out and retry
    write_checkpoint(s3_store, "r", preset("tiny"), steps=1)
    write_checkpoint(s3_store, "r", preset("tiny"), steps=2)  # LATEST: gc --keep 0 would remove only r@1
    store = Store(s3_store)
    reports, errors = [], []

    def gc_while_reading(method, target):
        try:
            reports.append(collect(Store(s3_store), keep=0, run="r"))
        except Exception as error:  # surfaced by the assertions below
            errors.append(error)

    fault_proxy.add("delay", method="GET", path=r"\.safetensors", times=1, callback=gc_while_reading)
    argv = ["ckpt", *[a.format(tmp=tmp_path) for a in COMMANDS[command]], "--store", s3_store]
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("rc", main(argv)))
    thread.start()
    thread.join(120)
    assert not thread.is_alive() and not errors
    assert result["rc"] == (1 if command == "diff" else 0)  # diff: the two steps hold different weights
    [report] = reports
    assert report.removed_checkpoints == []
    assert {url.rsplit("/", 1)[-1]: why for url, why in report.kept} == \
        {"step-00000001": "being read (1 reader lease(s))", "step-00000002": "LATEST names it"}
    assert store.committed_steps("r") == [1, 2]
    # The lease is gone with the command: the same gc now removes the checkpoint.
    assert [url.rsplit("/", 1)[-1] for url in collect(store, keep=0, run="r").removed_checkpoints] == ["step-00000001"]
