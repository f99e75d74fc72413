"""`rayshard.checkpoint` from a user's own loop (tests/integration/api_checkpoint_job.py): real gloo
ranks forked from the test (no Ray, no rayshard trainer), real files and moto S3.

Layout changes are checked bit for bit (`ckpt diff` of the saved checkpoint and one saved again
right after loading it on the other layout) and by training on: the losses of the resumed steps
match an uninterrupted run's within 2.5e-6 relative. The 4-rank FSDP2 x TP case under torchrun is
tests/integration/test_api_checkpoint_torchrun.py (slow).
"""
from __future__ import annotations

import datetime
import os
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

import rayshard.checkpoint as ckpt
from rayshard.cluster.api import checkpoint as api
from rayshard.cluster.catalog.catalog import Catalog
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.digest import diff_checkpoints, digest_checkpoint
from rayshard.cluster.cli.main import main
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.storage.manifest_io import read_manifest
from tests.forked_ranks import run_ranks
from tests.free_port import free_port
from tests.integration.api_checkpoint_job import forked_job, run

TOLERANCE = 2.5e-6


@pytest.fixture(autouse=True)
def _bounded_exchanges(monkeypatch):
    monkeypatch.setenv("RAYSHARD_CHECKPOINT_TIMEOUT_S", "60")  # forked ranks inherit it


def _ranks(world: int, **spec) -> list[dict]:
    results = run_ranks(forked_job, world, spec)
    return [results[rank] for rank in range(world)]


def _close(losses: dict, reference: dict) -> None:
    assert losses, "no step was trained"
    for step, loss in losses.items():
        assert abs(loss - reference[step]) <= TOLERANCE * abs(reference[step]), (step, loss, reference[step])


def _equal(url_a: str, url_b: str) -> int:
    differences = diff_checkpoints(url_a, url_b)
    assert [d for d in differences if d.status != "equal"] == []
    return len(differences)


def test_tp2_state_is_written_once_and_one_process_continues_it_bit_for_bit(tmp_path):
    runs = tmp_path / "runs"
    first, _ = _ranks(2, mesh=[["tp", 2]], where=f"{runs}/a", steps=6, save_at=[3])
    assert "exception" not in first and first["refs"] == [f"{runs}/a/checkpoints/step-00000003"]
    chunks, metadata = read_manifest(first["refs"][0])
    # Under tp alone `norm` and `head` stay plain tensors on both ranks, and AdamW's step counts
    # are plain tensors: each is written once, and the two ranks share the writing.
    per_tensor = {}
    for chunk in chunks:
        per_tensor.setdefault((chunk.name, chunk.kind), []).append(chunk)
    assert [len(per_tensor[("head.weight", kind)]) for kind in ("param", "exp_avg", "exp_avg_sq", "step")] == [1, 1, 1, 1]
    assert len(per_tensor[("up.weight", "param")]) == 2 and len({chunk.file for chunk in chunks}) == 2
    assert metadata["writer"] == "rayshard.checkpoint" and metadata["layout"] == {"world_size": 2, "mesh": {"tp": 2}}
    assert metadata["state"]["train"] == {"step": 3, "note": "after step 3"} and metadata["metadata"] == {"by": "job"}

    resumed = run({"load": f"{runs}/a", "resave": f"{runs}/b", "steps": 6})  # this process, no process group
    assert resumed["loaded_step"] == 3 and resumed["note"] == "after step 3" and resumed["loaded_metadata"] == {"by": "job"}
    assert _equal(first["refs"][0], resumed["resaved"]) == 28
    _close(resumed["losses"], first["losses"])


def test_uneven_fsdp2_shards_load_on_tp2_and_the_cli_reads_both(tmp_path, capsys):
    runs = tmp_path / "runs"
    with capsys.disabled():  # forked ranks dump their stacks to the real stderr if they hang
        saved = _ranks(2, mesh=[["dp_shard", 2]], where=f"{runs}/a", steps=2, save_at=[2])
        loaded = _ranks(2, mesh=[["tp", 2]], load=f"{runs}/a@2", resave=f"{runs}/b", steps=2)
    assert all("exception" not in report for report in saved + loaded), saved + loaded
    url_a, url_b = saved[0]["refs"][0], loaded[0]["resaved"]
    rows = {(c.name, c.kind, c.offsets, c.sizes) for c in read_manifest(url_a)[0]}
    assert ("down.weight", "param", (5, 0), (4, 22)) in rows  # 9 rows over fsdp2: 5 + 4
    _equal(url_a, url_b)

    def cli(*argv) -> tuple[int, list[str], list[str]]:
        code = main(list(argv) + ["--store", str(runs)])
        out, err = capsys.readouterr()
        return code, out.strip().splitlines(), err.strip().splitlines()

    code, out, _ = cli("ckpt", "ls")
    assert code == 0 and any(line.split()[:3] == ["a", "2", "*"] and "dp_shard2" in line for line in out)
    assert any(line.split()[:3] == ["b", "2", "*"] and "tp2" in line for line in out)
    assert cli("ckpt", "verify", "a@2", "--deep")[0] == 0
    digests = [cli("ckpt", "digest", run)[1][-1].split()[2] for run in ("a", "b")]
    assert digests[0] == digests[1] and digests[0].startswith("sha256:")
    assert cli("ckpt", "diff", "a@2", "b@2")[0] == 0
    for argv in (("ckpt", "reshard", "a@2", "--to", "fsdp=2", "--run", "c", "--local"),
                 ("ckpt", "export", "a@2", "--out", str(tmp_path / "hf")), ("ckpt", "plan", "a@2", "--to", "tp=2")):
        code, _, err = cli(*argv)
        assert code == 2 and len(err) == 1 and "saved by rayshard.checkpoint without a model" in err[0] \
            and "Fix: pass the model it holds with --model PRESET" in err[0]
    assert Store(str(runs)).committed_steps("c") == []


def test_a_rank_that_fails_fails_every_rank_naming_it_and_nothing_is_committed(tmp_path):
    runs = tmp_path / "runs"
    reports = _ranks(2, mesh=[["dp_shard", 2]], where=f"{runs}/a", steps=2, save_at=[1, 2], fail_at=2, fail_rank=1)
    assert reports[1]["error"].startswith("Fail: this rank's state dict could not be read")
    assert reports[0]["error"].startswith(f"RanksFailed: save of {runs}/a@2 failed on rank 1: Fail: this rank's")
    assert "\n" not in reports[0]["error"]
    store = Store(str(runs))
    assert store.committed_steps("a") == [1] and store.latest_step("a") == 1


def _killed_job(rank: int, init_method: str, world_size: int, results, spec: dict) -> None:
    forked_job(rank, init_method, world_size, results, spec)


def test_a_rank_killed_mid_save_leaves_no_checkpoint_and_the_other_stops_at_once(tmp_path):
    """Rank 1 writes its shard and is killed -9 before the chunks are gathered: rank 0 fails in
    one line at that exchange (not at the 60 s bound), LATEST stays, the files are a leftover."""
    runs = tmp_path / "runs"
    spec = {"mesh": [["dp_shard", 2]], "where": f"{runs}/a", "steps": 2, "save_at": [1, 2], "kill_at": 2}
    with mp.Manager() as manager:
        results = manager.dict()
        context = mp.start_processes(_killed_job, args=(f"tcp://127.0.0.1:{free_port()}", 2, results, spec), nprocs=2,
                                     start_method="fork", join=False)
        started = time.monotonic()
        for process in context.processes:
            process.join(timeout=120)
        waited = time.monotonic() - started
        codes = [process.exitcode for process in context.processes]
        reports = dict(results)
    assert codes[1] == -9 and codes[0] == 0, codes
    error = reports[0]["error"]
    assert error.startswith(f"CheckpointError: save of {runs}/a@2: rank 0 lost the other ranks while collecting the chunks")
    assert "\n" not in error and waited < 60  # not the exchange's bound: the peer's closed connection
    store = Store(str(runs))
    assert store.committed_steps("a") == [1] and store.latest_step("a") == 1
    assert [entry.step for entry in Catalog(store).checkpoints("a")] == [1]
    leftovers = Catalog(store).leftovers("a")
    assert leftovers and all("step-00000002" in leftover.path for leftover in leftovers)


def test_an_async_save_returns_before_its_write_and_saves_the_state_it_was_given(tmp_path, monkeypatch):
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"model": {"w": weight}, "train": {"step": 5, "seen": [1, 2]}}
    release, writing = threading.Event(), threading.Event()
    real = api._write_share

    def held_write(share, snapshot):
        writing.set()
        assert release.wait(timeout=60)
        return real(share, snapshot)

    monkeypatch.setattr(api, "_write_share", held_write)
    future = ckpt.async_save(state, str(tmp_path / "runs" / "r"), step=5)
    assert writing.wait(timeout=60) and not future.done()
    weight.add_(100.0)  # the caller trains on: neither change may reach the checkpoint
    state["train"]["seen"].append(3)
    release.set()
    ref = future.result(timeout=60)
    assert (ref.run, ref.step) == ("r", 5) and Store(str(tmp_path / "runs")).latest_step("r") == 5
    fresh = {"model": {"w": torch.zeros(3, 4)}, "train": {"step": 0, "seen": []}}
    ckpt.load(fresh, str(tmp_path / "runs" / "r"))
    assert torch.equal(fresh["model"]["w"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert fresh["train"] == {"step": 5, "seen": [1, 2]}


class _NormedNet(torch.nn.Module):
    """A weight the optimizer writes and a buffer a forward writes (BatchNorm's running mean)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.up = torch.nn.Linear(5, 7)
        self.norm = torch.nn.BatchNorm1d(7)

    def forward(self, x):
        return self.norm(self.up(x))


def _train_step(net, optimizer, step: int, then_step: bool = True) -> None:
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(6, 5, generator=generator) * torch.linspace(0.5, 3.0, 5) + torch.arange(5) * 0.2
    net(x).pow(2).mean().backward()
    if then_step:
        optimizer.step()
        optimizer.zero_grad()


def test_an_async_save_given_the_optimizer_copies_its_tensors_beside_the_next_backward(tmp_path, monkeypatch):
    """async_save(..., optimizer=opt) returns before the parameters and moments are copied; the
    next forward and backward run meanwhile (changing the buffer, copied at the call); the next
    optimizer.step() waits for the copy. The checkpoint holds the state as it was at the call."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from rayshard.actors.checkpoint.deferred_copy import DeferredCopy

    net = _NormedNet()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05)
    _train_step(net, optimizer, 1)
    model_state, optim_state = get_state_dict(net, optimizer)
    expected = {key: value.clone() for key, value in net.state_dict().items()}
    moments = {key: value.clone() for key, value in optimizer.state[net.up.weight].items()}
    release, copying = threading.Event(), threading.Event()
    real_run = DeferredCopy.run

    def held_run(self, staging, into):
        copying.set()
        assert release.wait(timeout=60)
        return real_run(self, staging, into)

    monkeypatch.setattr(DeferredCopy, "run", held_run)
    future = ckpt.async_save({"model": model_state, "optim": optim_state}, str(tmp_path / "runs" / "r"), step=1,
                             optimizer=optimizer)
    assert copying.wait(timeout=60) and not future.done()  # returned while the copy waits
    _train_step(net, optimizer, 2, then_step=False)  # forward and backward run beside the copy
    assert not torch.equal(net.norm.running_mean, expected["norm.running_mean"])
    stepping = threading.Thread(target=optimizer.step)
    stepping.start()
    stepping.join(timeout=0.5)
    assert stepping.is_alive()  # held by the pre-hook until the copy is done
    assert torch.equal(net.up.weight, expected["up.weight"])
    release.set()
    stepping.join(timeout=60)
    assert not stepping.is_alive() and not torch.equal(net.up.weight, expected["up.weight"])
    assert future.result(timeout=60).step == 1

    fresh = _NormedNet()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    _train_step(fresh, fresh_optimizer, 7)  # its own state, to be overwritten
    fresh_model, fresh_optim = get_state_dict(fresh, fresh_optimizer)
    ckpt.load({"model": fresh_model, "optim": fresh_optim}, str(tmp_path / "runs" / "r"))
    for key, value in expected.items():  # the buffer as at the call, not after the next forward
        assert torch.equal(fresh_model[key], value), key
    for kind, value in moments.items():
        assert torch.equal(fresh_optim["state"]["up.weight"][kind], value), kind
    # One hook per optimizer, kept, and free once the copy is done: more saves add none, steps go on.
    for step in (2, 3):
        ckpt.async_save({"model": get_state_dict(net, optimizer)[0]}, str(tmp_path / "runs" / "r"), step=step,
                        optimizer=optimizer).result(timeout=60)
        _train_step(net, optimizer, step + 10)
    assert len(optimizer._optimizer_step_pre_hooks) == 1


def test_a_deferred_copy_that_fails_fails_the_save_and_lets_the_step_go_on(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    net = _NormedNet()
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.05)
    _train_step(net, optimizer, 1)
    real_copy = api._STAGING.copy

    def copy(keys, tensors, after=None):
        if after is not None:  # the deferred copy's call (the immediate one passes no events)
            raise MemoryError("host memory is full (a test's injected failure)")
        return real_copy(keys, tensors)

    monkeypatch.setattr(api._STAGING, "copy", copy)
    model_state, optim_state = get_state_dict(net, optimizer)
    future = ckpt.async_save({"model": model_state, "optim": optim_state}, str(tmp_path / "runs" / "r"), step=1,
                             optimizer=optimizer)
    assert isinstance(future.exception(timeout=60), MemoryError)
    stepping = threading.Thread(target=_train_step, args=(net, optimizer, 2))
    stepping.start()
    stepping.join(timeout=60)
    assert not stepping.is_alive()  # not held until the copy's bound
    assert Store(str(tmp_path / "runs")).committed_steps("r") == []


def test_an_async_save_with_the_optimizer_saves_what_a_blocking_save_does_on_fsdp2(tmp_path):
    """Two identical FSDP2 runs: one saves step 2 blocking, the other with async_save given the
    optimizer, training on at once; the checkpoints are equal tensor for tensor, moments included."""
    runs = tmp_path / "runs"
    blocking = _ranks(2, mesh=[["dp_shard", 2]], where=f"{runs}/blocking", steps=3, save_at=[2])
    deferred = _ranks(2, mesh=[["dp_shard", 2]], where=f"{runs}/deferred", steps=3, async_at=[2], async_optimizer=True,
                      hold_copy_s=0.5)
    assert all("error" not in report and "exception" not in report for report in blocking + deferred), (blocking, deferred)
    # Every tensor of the state dict is a parameter or its AdamW state (7 parameters, 3 states
    # each), so all 28 pieces were copied late, while step 3's forward and backward ran; step 3's
    # optimizer.step() waited for them, or the checkpoint would hold step 3's values.
    assert [report["deferred"] for report in deferred] == [28, 28]
    assert _equal(blocking[0]["refs"][0], deferred[0]["refs"][0]) == 28
    assert deferred[0]["losses"] == blocking[0]["losses"]


def _async_save_in_child(rank: int, init_method: str, world_size: int, results, where: str) -> None:
    try:
        results[rank] = ckpt.async_save({"model": {"w": torch.ones(3)}}, where, step=2).result(timeout=30).step
    except Exception as error:  # noqa: BLE001 (the test reads the line)
        results[rank] = f"{type(error).__name__}: {error}"


def test_a_process_forked_after_an_async_save_saves_asynchronously_too(tmp_path):
    """The parent's saving thread does not survive a fork: the child gets its own (it waited
    forever on the inherited executor before)."""
    assert ckpt.async_save({"model": {"w": torch.ones(3)}}, str(tmp_path / "runs" / "parent"), step=1).result(timeout=60)
    assert run_ranks(_async_save_in_child, 1, str(tmp_path / "runs" / "child"))[0] == 2


def test_an_async_save_refuses_an_optimizer_that_is_not_one_in_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="optimizer= takes a torch.optim.Optimizer") as error:
        ckpt.async_save({"model": {"w": torch.ones(2)}}, str(tmp_path / "runs" / "r"), step=1, optimizer="adam")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "runs" / "r" / "LATEST").exists()


def test_plain_tensors_and_values_round_trip_and_mismatches_are_refused_in_one_line(tmp_path):
    where = str(tmp_path / "runs" / "r")
    state = {"model": {"w": torch.randn(5, 3), "half": torch.randn(4).to(torch.bfloat16)},
             "extra": {"ids": torch.arange(7), "flag": torch.tensor(True), "scalar": torch.tensor(2.5),
                       "nested": [torch.ones(2), {"deep": torch.zeros(1, 2)}]},
             "config": {"name": "run-7", "lrs": [1e-3, None, float("inf")], "betas": (0.9, 0.95), "on": False}}
    assert ckpt.save(state, where, step=1, metadata={"why": "test"}).step == 1
    fresh = {"model": {"w": torch.zeros(5, 3), "half": torch.zeros(4, dtype=torch.bfloat16)},
             "extra": {"ids": torch.zeros(7, dtype=torch.int64), "flag": torch.tensor(False), "scalar": torch.tensor(0.0),
                       "nested": [torch.zeros(2), {"deep": torch.ones(1, 2)}]},
             "config": {"name": "", "lrs": [], "betas": (0.0, 0.0), "on": True}}
    loaded = ckpt.load(fresh, where)
    assert loaded.metadata == {"why": "test"} and loaded.step == 1
    for key in ("w", "half"):
        assert torch.equal(fresh["model"][key], state["model"][key])
    assert torch.equal(fresh["extra"]["ids"], torch.arange(7)) and fresh["extra"]["flag"].item() is True
    assert fresh["extra"]["scalar"].item() == 2.5 and torch.equal(fresh["extra"]["nested"][1]["deep"], torch.zeros(1, 2))
    assert fresh["config"] == {"name": "run-7", "lrs": [1e-3, None, float("inf")], "betas": (0.9, 0.95), "on": False}
    assert isinstance(fresh["config"]["betas"], tuple)
    assert ckpt.load({"model": {"w": torch.zeros(5, 3)}}, f"{where}@1").step == 1  # a part of the checkpoint

    def refused(state_dict, *fragments):
        with pytest.raises(CheckpointError) as error:
            ckpt.load(state_dict, where)
        assert "\n" not in str(error.value) and all(f in str(error.value) for f in fragments), str(error.value)

    refused({"model": {"w": torch.zeros(5, 4)}}, "'model.w' is float32[5, 3] in the checkpoint but float32[5, 4] in the state dict")
    refused({"model": {"w": torch.zeros(5, 3, dtype=torch.float64)}}, "'model.w' is float32[5, 3]", "float64[5, 3]")
    refused({"model": {"v": torch.zeros(5, 3)}, "other": 1}, "'model.v' is not in the checkpoint",
            "(and 1 more: 'other' is not in the checkpoint)")
    refused({"config": torch.zeros(1)}, "'config' is a value in the checkpoint, not a tensor")
    refused({"config": {"name": torch.zeros(1)}}, "'config.name' is inside the value 'config' in the checkpoint, not a tensor")
    with pytest.raises(CheckpointError, match=r"r@1 is already committed .* never overwritten"):
        ckpt.save(state, where, step=1)
    with pytest.raises(ConfigError, match=r"names a run, not a checkpoint"):
        ckpt.save(state, f"{where}@2", step=2)
    with pytest.raises(CheckpointError, match=r"entry 'config': config.when is a datetime.datetime, neither a tensor nor a JSON value"):
        ckpt.save({"model": {"w": torch.zeros(1)}, "config": {"when": datetime.datetime.now()}}, where, step=2)
    with pytest.raises(CheckpointError, match=r"run 'nope' has no committed checkpoint"):
        ckpt.load(fresh, str(tmp_path / "runs" / "nope"))
    assert Store(str(tmp_path / "runs")).committed_steps("r") == [1]


def test_a_load_plan_says_what_each_rank_reads_without_reading(tmp_path):
    where = str(tmp_path / "runs" / "r")
    ckpt.save({"model": {"w": torch.randn(64, 16), "b": torch.randn(16)}}, where, step=3)
    plan = ckpt.plan({"model": {"w": torch.zeros(64, 16), "b": torch.zeros(16)}}, where)
    (rank,) = plan.ranks
    assert (plan.step, rank.pieces, rank.bytes_needed) == (3, 2, (64 * 16 + 16) * 4)
    assert rank.bytes_read >= rank.bytes_needed and rank.files == 1
    assert plan.describe().startswith(f"load of {where}/checkpoints/step-00000003 (step 3) on 1 rank(s)")


def test_fsdp2_ranks_save_to_s3_and_one_process_loads_it(s3_store, tmp_path):
    saved = _ranks(2, mesh=[["dp_shard", 2]], where=f"{s3_store}/a", steps=3, save_at=[2])
    assert all("exception" not in report for report in saved) and saved[0]["refs"] == [f"{s3_store}/a/checkpoints/step-00000002"]
    resumed = run({"load": f"{s3_store}/a", "resave": str(tmp_path / "runs" / "b"), "steps": 3})
    assert resumed["loaded_step"] == 2
    _equal(saved[0]["refs"][0], resumed["resaved"])
    _close(resumed["losses"], saved[0]["losses"])


def _load_rows(rank: int, init_method: str, world_size: int, results, where: str) -> None:
    """Load a (8, 6) tensor as a DTensor sharded by rows over the ranks, after a plan of it."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        weight = distribute_tensor(torch.zeros(8, 6), init_device_mesh("cpu", (world_size,), mesh_dim_names=("rows",)),
                                   [Shard(0)])
        state = {"model": {"w": weight}}
        report = {"plan": [(r.rank, r.bytes_needed) for r in ckpt.plan(state, where).ranks]}
        try:
            ckpt.load(state, where)
            report["local"] = weight.to_local().tolist()
        except CheckpointError as error:
            report["error"] = f"{type(error).__name__}: {error}"
        results[rank] = report
    finally:
        dist.destroy_process_group()


def test_chunks_read_in_parts_by_several_ranks_are_verified_together(tmp_path):
    """One stored chunk, two ranks each reading half of it: neither can check its half alone, so
    the first rank combines both halves' checksums; a flipped byte fails every rank."""
    where = str(tmp_path / "runs" / "r")
    whole = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    ref = ckpt.save({"model": {"w": whole}}, where, step=1)
    good = [run_ranks(_load_rows, 2, where)[rank] for rank in range(2)]
    assert [report["local"] for report in good] == [whole[:4].tolist(), whole[4:].tolist()]
    assert good[0]["plan"] == good[1]["plan"] == [(0, 96), (1, 96)]

    (chunk,) = read_manifest(ref.url)[0]
    path = f"{ref.url}/{chunk.file}"
    with open(path, "r+b") as handle:  # one byte of the second half's first row
        handle.seek(chunk.byte_start + 4 * 6 * 4 + 1)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    bad = [run_ranks(_load_rows, 2, where)[rank] for rank in range(2)]
    assert bad[0]["error"].startswith("CheckpointError: ") and "checksum mismatch" in bad[0]["error"]
    assert bad[1]["error"].startswith(f"RanksFailed: load of {where} failed on rank 0: CheckpointError: ")
    assert "checksum mismatch" in bad[1]["error"] and "\n" not in bad[1]["error"]


def _save_small(rank: int, init_method: str, world_size: int, results, where: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        ckpt.save({"model": {"w": torch.ones(3)}}, where, step=2)
        results[rank] = "saved"
    except CheckpointError as error:
        results[rank] = f"{type(error).__name__}: {error}"
    finally:
        dist.destroy_process_group()


def test_a_second_program_saving_into_a_run_being_written_is_refused(tmp_path):
    """This process saved into run r and keeps its writer lease; another process (forked from
    it, holding nothing of it) is refused in one line naming this one, and commits nothing."""
    where = str(tmp_path / "runs" / "r")
    ckpt.save({"model": {"w": torch.zeros(3)}}, where, step=1)
    (answer,) = run_ranks(_save_small, 1, where).values()
    assert answer.startswith("RunBusy: run 'r' is being trained by pid ") and f"pid {os.getpid()} " in answer
    assert "\n" not in answer and Store(str(tmp_path / "runs")).committed_steps("r") == [1]
    assert ckpt.save({"model": {"w": torch.zeros(3)}}, where, step=3).step == 3  # this process still holds it
