"""An async save's snapshot is the state of the step it was asked at, even when the copy is slower
than the next forward/backward: the optimizer step waits for it (no Ray, no process group)."""
import threading
import time

import torch

import actors.checkpoint.async_save as async_save
from actors.checkpoint.manifest_io import read_manifest
from actors.checkpoint.rank_pieces import state_tensors
from plans.checkpoint.manifest import encode_manifest
from actors.checkpoint.checksums import checksum
from plans.checkpoint.chunks import Chunk


def _trained_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_the_next_optimizer_step_waits_for_a_slow_snapshot(tmp_path, monkeypatch):
    model, optimizer = _trained_model()
    expected = {(name, kind): checksum(t.detach().contiguous().numpy().tobytes()) for name, kind, t in state_tensors(model, optimizer)}
    release = threading.Event()
    saver = async_save.AsyncSaver()
    real_buffer = saver._host_buffer

    def slow_buffer(key, tensor):
        release.wait(timeout=30)  # the copy cannot start until the test says so
        return real_buffer(key, tensor)

    monkeypatch.setattr(saver, "_host_buffer", slow_buffer)
    save = saver.start(model, optimizer, str(tmp_path / "ckpt"), "attempt-a/rank-00000.safetensors", 0)
    model(torch.randn(8, 16)).square().mean().backward()  # the next step's forward and backward run meanwhile
    stepper = threading.Thread(target=optimizer.step)
    stepper.start()
    time.sleep(0.3)
    assert stepper.is_alive()  # held by the pre-hook: the copy has not happened yet
    release.set()
    stepper.join(timeout=30)
    status = save.status(wait=True)
    assert status["error"] is None and status["optimizer_wait_seconds"] > 0.2
    chunks = [Chunk.from_row(row) for row in status["rows"]]
    (tmp_path / "ckpt" / "manifest.parquet").write_bytes(encode_manifest(chunks, {"step": 2}))
    stored, _ = read_manifest(str(tmp_path / "ckpt"))
    assert {(c.name, c.kind): c.checksum for c in stored} == expected  # the state before the third step
    assert any(checksum(p.detach().numpy().tobytes()) != expected[(n, "param")] for n, p in model.named_parameters())
