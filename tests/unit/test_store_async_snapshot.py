"""An async save's snapshot is the state of the step it was asked at, even when the copy is slower
than the next forward/backward: the optimizer step waits for it (no Ray, no process group)."""
import threading

import torch

import rayshard.actors.checkpoint.async_save as async_save
from rayshard.storage.manifest_io import read_manifest
from rayshard.actors.checkpoint.rank_pieces import state_tensors
from rayshard.plans.checkpoint.manifest.codec import encode_manifest
from rayshard.storage.checksums import checksum
from rayshard.plans.checkpoint.chunks import Chunk


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
    release, copy_held = threading.Event(), threading.Event()
    saver = async_save.AsyncSaver()
    real_buffer = saver.staging._buffer

    def slow_buffer(key, tensor):
        copy_held.set()
        release.wait(timeout=60)  # the copy cannot go on until the test says so
        return real_buffer(key, tensor)

    monkeypatch.setattr(saver.staging, "_buffer", slow_buffer)
    # Pre-hooks run in the order registered: one before the saver's, one after it (which runs
    # only once the saver's hook lets the step through).
    step_started, step_let_through = threading.Event(), threading.Event()
    optimizer.register_step_pre_hook(lambda *_: step_started.set())
    save = saver.start(model, optimizer, str(tmp_path / "ckpt"), "attempt-a/rank-00000.safetensors", 0)
    optimizer.register_step_pre_hook(lambda *_: step_let_through.set())
    model(torch.randn(8, 16)).square().mean().backward()  # the next step's forward and backward run meanwhile
    stepper = threading.Thread(target=optimizer.step)
    stepper.start()
    assert copy_held.wait(timeout=60) and step_started.wait(timeout=60)
    # The copy is held and the step has begun: a saver that did not hold the step would let it
    # through at once (within microseconds); this waits a generous half second for that to show.
    assert not step_let_through.wait(timeout=0.5)
    release.set()
    stepper.join(timeout=60)
    assert not stepper.is_alive() and step_let_through.is_set()
    status = save.status(wait=True)
    assert status["error"] is None and status["optimizer_wait_seconds"] > 0
    chunks = [Chunk.from_row(row) for row in status["rows"]]
    (tmp_path / "ckpt" / "manifest.parquet").write_bytes(encode_manifest(chunks, {"step": 2}))
    stored, _ = read_manifest(str(tmp_path / "ckpt"))
    assert {(c.name, c.kind): c.checksum for c in stored} == expected  # the state before the third step
    assert any(checksum(p.detach().numpy().tobytes()) != expected[(n, "param")] for n, p in model.named_parameters())


def _digests(model, optimizer) -> dict:
    return {(name, kind): checksum(t.detach().contiguous().numpy().tobytes()) for name, kind, t in state_tensors(model, optimizer)}


def _step(model, optimizer) -> None:
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_next_save_stages_while_the_previous_one_still_uploads_and_neither_mixes_steps(tmp_path, monkeypatch):
    """Snapshots every step (decision 163): staging step s+1 does not wait for step s's upload;
    each save still holds exactly the state of its own step."""
    model, optimizer = _trained_model()
    upload_held, release = threading.Event(), threading.Event()
    real_write = async_save.write_shard

    def held_write(fs, base, file, pieces):
        if file.startswith("first/"):
            upload_held.set()
            release.wait(timeout=120)  # the first upload cannot end until the test says so
        return real_write(fs, base, file, pieces)

    monkeypatch.setattr(async_save, "write_shard", held_write)
    saver = async_save.AsyncSaver()
    at_first = _digests(model, optimizer)
    first = saver.start(model, optimizer, str(tmp_path / "one"), "first/rank-00000.safetensors", 0)
    assert upload_held.wait(timeout=60)
    _step(model, optimizer)  # the next step's optimizer step (waits for the first copy only)
    at_second = _digests(model, optimizer)
    started = threading.Event()
    second_box = []
    starter = threading.Thread(target=lambda: (second_box.append(
        saver.start(model, optimizer, str(tmp_path / "two"), "second/rank-00000.safetensors", 0)), started.set()))
    starter.start()
    # With one staging buffer the second save would wait here for the first upload, held above.
    assert started.wait(timeout=60), "the second save waited for the first one's upload"
    second = second_box[0]
    assert second.status(wait=True, timeout_s=60)["done"] and not first.status()["done"]
    _step(model, optimizer)  # the live state moves on again while the first upload is still held
    release.set()
    for save, where, expected in ((first, "one", at_first), (second, "two", at_second)):
        status = save.status(wait=True, timeout_s=60)
        assert status["error"] is None
        chunks = [Chunk.from_row(row) for row in status["rows"]]
        (tmp_path / where / "manifest.parquet").write_bytes(encode_manifest(chunks, {"step": 1}))
        stored, _ = read_manifest(str(tmp_path / where))
        assert {(c.name, c.kind): c.checksum for c in stored} == expected
    assert at_first != at_second
