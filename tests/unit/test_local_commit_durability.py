"""A checkpoint committed to a local directory survives a power loss, not only a killed process:
every shard file and its directory entry are synced to disk before the manifest that names them
is, and the manifest's name is synced with its directory and the step's (decision 222). Checked
by recording, in order, what this process asks the kernel to sync during a real save."""
from __future__ import annotations

import os

import torch

import rayshard.checkpoint as ckpt


def test_shards_and_their_names_reach_the_disk_before_the_manifest(tmp_path, monkeypatch):
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(descriptor: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    state = {"model": {"w": torch.arange(600.0).reshape(20, 30), "b": torch.ones(7)}}
    ref = ckpt.save(state, str(tmp_path / "run"), step=3)
    shards = [os.path.join(root, name) for root, _, names in os.walk(ref.url) for name in names
              if name.endswith(".safetensors")]
    assert shards
    manifest_bytes = next(index for index, path in enumerate(synced) if ".tmp" in path and "manifest" in path)
    for shard in shards:
        assert synced.index(shard) < manifest_bytes  # the shard's bytes, then its name, before the manifest
        assert synced.index(os.path.dirname(shard)) < manifest_bytes
    after = synced[manifest_bytes + 1:]
    assert ref.url in after and os.path.dirname(ref.url) in after  # the manifest's name, and the step directory's
