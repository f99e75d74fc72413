"""The catalog on S3 (moto) and a local directory: ls shows whole checkpoints only, verify finds
missing, truncated and corrupted shards, gc keeps LATEST, leased and young things and removes the
rest, including orphaned attempts and pending multipart uploads. No Ray: checkpoints are written
by the same shard writer the ranks use."""
from __future__ import annotations

import json
import re
import time

import fsspec
import pytest
import torch

from rayshard.actors.checkpoint.read_executor import Destination
from rayshard.actors.checkpoint.shard_writer import Piece, write_shard
from rayshard.actors.checkpoint.stored import StoredCheckpoint

from rayshard.plans.checkpoint.manifest.codec import encode_manifest
from rayshard.cluster.catalog import leases
from rayshard.cluster.catalog.catalog import Catalog
from rayshard.cluster.cli.main import main
from rayshard.cluster.catalog.retention import collect
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.verify import verify
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.reshard import Target
from rayshard.plans.errors import CheckpointError, ConfigError, StoreUnavailable
from rayshard.storage.options import configure


@pytest.fixture(params=["s3", "local"])
def store(request, tmp_path):
    url = request.getfixturevalue("s3_store") if request.param == "s3" else str(tmp_path / "store")
    return Store(url)


def write_checkpoint(store: Store, run: str, step: int, parent: str | None = None, commit: bool = True,
                     ranks: int = 2) -> tuple[str, str]:
    """Two 'ranks' each write half of an asymmetric tensor under a fresh attempt; the manifest
    commits them. Returns (checkpoint URL, attempt)."""
    pending = store.begin(run, step)
    fs, base = fsspec.core.url_to_fs(pending.url)
    weight = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4) * 0.5 + step
    rows = 64 // ranks
    chunks: list[Chunk] = []
    for rank in range(ranks):
        piece = Piece("w", "param", weight[rank * rows:(rank + 1) * rows], (64, 4), (rank * rows, 0))
        chunks += write_shard(fs, base, pending.file_for(rank), [piece])
    if commit:
        metadata = {"run": run, "step": step, "layout": {"dp": 1, "fsdp": ranks, "tp": 1, "pp": 1},
                    "model_preset": "tiny", "parent": parent, "created_unix": time.time()}
        pending.commit(chunks, metadata)
    return pending.url, pending.attempt


def test_ls_shows_whole_checkpoints_and_leftovers_separately(store, capsys):
    first, _ = write_checkpoint(store, "r", 2)
    write_checkpoint(store, "r", 4, parent=first)
    _, crashed = write_checkpoint(store, "r", 6, commit=False)  # a save that died before its manifest
    catalog = Catalog(store)
    entries = catalog.checkpoints("r")
    assert [(e.step, e.status, e.latest, e.layout, e.files, e.chunks) for e in entries] == \
        [(2, "ok", False, "fsdp2", 2, 2), (4, "ok", True, "fsdp2", 2, 2)]
    assert entries[1].parent == first and entries[0].size_bytes > 64 * 4 * 4
    [leftover] = catalog.leftovers("r")
    assert (leftover.step, leftover.kind, leftover.path.rsplit("/", 1)[-1], leftover.objects) == (6, "incomplete save", crashed, 2)

    assert main(["ckpt", "ls", "--store", store.url, "--all"]) == 0
    out = capsys.readouterr().out
    assert "4 *" in out and "fsdp2" in out and "step-00000006" not in out.split("leftover")[0]
    assert "leftover: incomplete save" in out
    assert main(["ckpt", "ls", "--store", store.url, "--run", "r", "--json"]) == 0
    records = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["latest"], r["status"]) for r in records] == [(2, False, "ok"), (4, True, "ok")]


def test_catalog_is_a_pyarrow_dataset(store):
    first, _ = write_checkpoint(store, "a", 1)
    write_checkpoint(store, "a", 2, parent=first)
    write_checkpoint(store, "b", 5)
    import pyarrow.compute as pc

    table = Catalog(store).dataset().to_table(filter=pc.field("latest"))
    assert sorted(zip(table["run"].to_pylist(), table["step"].to_pylist())) == [("a", 2), ("b", 5)]
    chunks = Catalog(store).chunks_dataset().to_table()
    assert chunks.num_rows == 6 and set(chunks["run"].to_pylist()) == {"a", "b"}
    assert set(chunks["checkpoint"].to_pylist()) == {"step-00000001", "step-00000002", "step-00000005"}


def test_verify_finds_missing_truncated_and_corrupted_shards(store, capsys):
    url, attempt = write_checkpoint(store, "r", 2)
    assert verify(url, deep=True).ok
    assert verify(url, deep=True, window_bytes=16).ok  # headers and chunks larger than the window, read in pieces
    shard0, shard1 = (f"{store.root}/r/checkpoints/step-00000002/{attempt}/rank-0000{i}.safetensors" for i in (0, 1))
    data = bytearray(store.fs.cat_file(shard0))
    data[-3] ^= 0xFF  # same size, one flipped byte: only --deep sees it
    store.fs.pipe_file(shard0, bytes(data))
    assert verify(url).ok
    deep = verify(url, deep=True)
    assert len(deep.problems) == 1 and "checksum mismatch in w (param)" in deep.problems[0]
    store.fs.pipe_file(shard1, store.fs.cat_file(shard1)[:-10])
    assert any("truncated" in p for p in verify(url).problems)
    assert main(["ckpt", "verify", "r@2", "--store", store.url, "--deep", "--quiet"]) == 1
    assert "FAILED" in capsys.readouterr().out
    store.fs.rm_file(shard1)
    assert any("missing" in p for p in verify(url).problems)
    assert Catalog(store).checkpoints("r")[0].status == "1 file(s) missing"


def test_gc_keeps_latest_leased_and_young_things(store, capsys):
    for step in (1, 2, 3, 4, 5):
        write_checkpoint(store, "r", step)
    _, crashed = write_checkpoint(store, "r", 6, commit=False)
    lease = leases.acquire(store, "r", 2)
    # LATEST goes back to step 1 (a resumed run forked from there): it must survive gc.
    store.fs.pipe_file(f"{store.root}/r/LATEST", b"step-00000001")

    young = collect(store, keep=1)  # default grace: the crashed save may still be running
    assert sorted(u.rsplit("/", 1)[-1] for u in young.removed_checkpoints) == ["step-00000003", "step-00000004"]
    assert any("LATEST" in why for _, why in young.kept) and any("reader lease" in why for _, why in young.kept)
    assert not young.removed_leftovers and Catalog(store).leftovers("r")

    leases.release(store, lease)
    assert main(["ckpt", "gc", "--keep", "1", "--store", store.url, "--grace", "0"]) == 0
    out = capsys.readouterr().out
    assert "removed checkpoint" in out and crashed in out
    assert store.committed_steps("r") == [1, 5] and store.latest_step("r") == 1
    assert Catalog(store).leftovers("r") == []
    assert verify(store.resolve("r@5").url, deep=True).ok and verify(store.resolve("r").url, deep=True).ok


def test_a_reader_that_arrives_while_gc_removes_its_checkpoint_keeps_it(store, monkeypatch):
    """gc listed the leases once, before removing anything: a reader that took its lease after that
    and found the manifest still there lost its shards. Here the reader arrives at the worst moment,
    just before gc removes the manifest: gc sees its lease afterwards and puts the manifest back."""
    for step in (1, 2, 3):
        write_checkpoint(store, "r", step)
    before = verify(store.resolve("r@2").url, deep=True)
    assert before.ok
    taken = []
    real_rm_file = store.fs.rm_file  # fsspec's async file systems bind their sync methods per instance

    def reader_arrives_first(path, *args, **kwargs):
        if path.endswith("step-00000002/manifest.parquet") and not taken:
            taken.append(leases.acquire(store, "r", 2))  # ...and sees the manifest, not yet removed
        return real_rm_file(path, *args, **kwargs)

    monkeypatch.setattr(store.fs, "rm_file", reader_arrives_first)
    report = collect(store, keep=1)
    assert taken and [u.rsplit("/", 1)[-1] for u in report.removed_checkpoints] == ["step-00000001"]
    assert any("put back" in why for url, why in report.kept if url.endswith("step-00000002")), report.kept
    assert store.committed_steps("r") == [2, 3] and verify(store.resolve("r@2").url, deep=True).ok
    leases.release(store, taken[0])


def test_a_checkpoint_named_by_url_is_leased_in_its_own_store(store, tmp_path):
    write_checkpoint(store, "r", 2)
    write_checkpoint(store, "r", 3)
    elsewhere = Store(str(tmp_path / "another-store"))  # the command's --store is not the checkpoint's
    ref = elsewhere.resolve(store.checkpoint_url("r", 2))
    assert (ref.run, ref.step) == (None, None)
    with leases.reading(elsewhere, ref) as lease:
        assert lease is not None and [held.path for held in leases.active(store, "r")[2]] == [lease.path]
        report = collect(store, keep=1, grace_s=0)
        assert store.committed_steps("r") == [2, 3] and any("reader lease" in why for _, why in report.kept)
    assert not leases.active(store, "r").get(2)
    # The same checkpoint copied outside any catalog is still readable, without a lease.
    outside = tmp_path / "loose" / "step-00000002"
    store.fs.get(f"{store.root}/r/checkpoints/step-00000002/", str(outside), recursive=True)
    with leases.reading(elsewhere, elsewhere.resolve(str(outside))) as lease:
        assert lease is None


def test_read_only_credentials_read_a_checkpoint_by_url_without_a_lease(store, monkeypatch, capsys):
    write_checkpoint(store, "r", 2)

    def denied(*args, **kwargs):
        raise PermissionError("Access Denied")

    monkeypatch.setattr(leases, "acquire", denied)  # what s3fs raises for a PutObject the policy refuses
    with leases.reading(store, store.resolve(store.checkpoint_url("r", 2))) as lease:
        assert lease is None
    assert "without a reader lease (PermissionError: Access Denied)" in capsys.readouterr().err
    with pytest.raises(PermissionError), leases.reading(store, store.resolve("r@2")):  # a catalog read still needs it
        pass


def test_gc_aborts_pending_multipart_uploads(s3_store):
    import boto3

    store = Store(s3_store)
    write_checkpoint(store, "r", 1)
    bucket, prefix = s3_store.removeprefix("s3://").split("/", 1)
    client = boto3.client("s3", endpoint_url=store.storage_conf["s3"]["endpoint_url"], region_name="us-east-1")
    upload = client.create_multipart_upload(Bucket=bucket, Key=f"{prefix}/r/checkpoints/step-00000002/attempt-x/rank-00000.safetensors")
    client.create_multipart_upload(Bucket=bucket, Key="elsewhere/not-ours")
    [pending] = [u for u in client.list_multipart_uploads(Bucket=bucket)["Uploads"] if u["Key"].startswith(prefix)]
    # moto reports every upload as initiated in 2010, so "young" is checked with gc's clock moved back.
    young = collect(store, keep=1, now=pending["Initiated"].timestamp() + 60)
    assert not young.aborted_uploads and any("multipart upload" in why for _, why in young.kept)
    report = collect(store, keep=1, grace_s=0)
    assert [p.rsplit("/", 1)[-1] for p in report.aborted_uploads] == ["rank-00000.safetensors"]
    remaining = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
    assert [u["Key"] for u in remaining] == ["elsewhere/not-ours"]
    assert upload["UploadId"] not in {u["UploadId"] for u in remaining}


def test_manifest_keys_escaping_the_checkpoint_are_refused_and_never_deleted(store):
    url, attempt = write_checkpoint(store, "victim", 1)
    fs, base = fsspec.core.url_to_fs(url)
    evil = Chunk("w", "param", "float32", (64, 4), (0, 0), (32, 4), f"../../../victim/checkpoints/step-00000001/{attempt}/rank-00000.safetensors",
                 0, 32 * 4 * 4, "crc32:00000000")  # a sound row: only its file escapes
    store.commit("evil", 1, encode_manifest([evil], {"run": "evil", "step": 1, "layout": {}}))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        store.resolve("evil@1")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):  # by URL, no resolve
        verify(store.checkpoint_url("evil", 1))
    store.fs.pipe_file(f"{store.root}/evil/LATEST", b"step-00000000")
    collect(store, keep=0, grace_s=0)
    assert verify(url, deep=True).ok  # the other run's shard is untouched


@pytest.mark.parametrize("latest", [None, b"garbage", b"\xff\xfe", b"step-00000099"])
def test_gc_keeps_the_newest_checkpoint_when_latest_is_missing_or_damaged(store, latest):
    """The newest committed step is what a resume takes when LATEST cannot say (decision 88), so
    gc must keep it: it once removed the run's only checkpoint here."""
    write_checkpoint(store, "r", 1)
    newest, _ = write_checkpoint(store, "r", 2)
    if latest is None:
        store.fs.rm_file(f"{store.root}/r/LATEST")
    else:
        store.fs.pipe_file(f"{store.root}/r/LATEST", latest)
    report = collect(store, keep=0, grace_s=0)
    assert store.committed_steps("r") == [2] and verify(newest, deep=True).ok
    assert [url.rsplit("/", 1)[-1] for url in report.removed_checkpoints] == ["step-00000001"]


@pytest.mark.parametrize("damage", ["no rows", "escaping file", "manifest a directory"])
def test_gc_never_removes_the_shards_of_a_checkpoint_whose_manifest_is_damaged(store, damage):
    url, attempt = write_checkpoint(store, "r", 1)
    fs, base = fsspec.core.url_to_fs(url)
    if damage == "manifest a directory":
        fs.rm_file(f"{base}/manifest.parquet")
        fs.makedirs(f"{base}/manifest.parquet", exist_ok=True)
        fs.pipe_file(f"{base}/manifest.parquet/part", b"x")
    else:
        chunks = [] if damage == "no rows" else [Chunk("w", "param", "float32", (64, 4), (0, 0), (64, 4),
                                                       "../../../x/rank-00000.safetensors", 0, 1024, "crc32:0")]
        fs.pipe_file(f"{base}/manifest.parquet", encode_manifest(chunks, {"run": "r", "step": 1, "layout": {}}))
    collect(store, keep=0, grace_s=0)
    assert fs.exists(f"{base}/{attempt}/rank-00000.safetensors") and fs.exists(f"{base}/{attempt}/rank-00001.safetensors")


def test_gc_and_ls_never_reach_outside_the_store(tmp_path, capsys):
    """`--run ../X` once made gc delete a checkpoint of another directory (issue 43, finding 3)."""
    store, victim = Store(str(tmp_path / "store")), Store(str(tmp_path / "victim-store"))
    write_checkpoint(store, "r", 1)
    write_checkpoint(victim, "v", 1)
    write_checkpoint(victim, "v", 2)
    escape = "../victim-store/v"
    for argv in (["ckpt", "gc", "--keep", "0", "--grace", "0", "--run", escape], ["ckpt", "ls", "--all", "--run", escape]):
        with pytest.raises(SystemExit) as exit_:
            main([*argv, "--store", store.url])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and f"{escape!r} is not a run name" in err, err
    for call in (lambda: collect(store, keep=0, run=escape, grace_s=0), lambda: Catalog(store).checkpoints(escape),
                 lambda: Catalog(store).leftovers(escape), lambda: store.resolve("..@1")):
        with pytest.raises(ConfigError, match="not a run name"):
            call()
    assert victim.committed_steps("v") == [1, 2] and verify(victim.checkpoint_url("v", 1), deep=True).ok


def _truncate_a_shard(store: Store, run: str, step: int, attempt: str) -> None:
    shard = f"{store.root}/{run}/checkpoints/step-{step:08d}/{attempt}/rank-00001.safetensors"
    store.fs.pipe_file(shard, store.fs.cat_file(shard)[:-10])


def test_gc_keeps_the_newest_whole_checkpoint_when_the_newest_is_damaged(store, capsys):
    """Issue 43, finding 2: with the newest checkpoint damaged (a truncated shard that `ckpt ls`
    itself reports), `gc --keep 1` removed every whole one and left the run unresumable."""
    attempts = {step: write_checkpoint(store, "r", step)[1] for step in (1, 2, 3, 4)}
    _truncate_a_shard(store, "r", 4, attempts[4])  # the newest, named by LATEST
    _truncate_a_shard(store, "r", 2, attempts[2])  # an older damaged one: a whole one newer than it stays
    assert [(e.step, e.status) for e in Catalog(store).checkpoints("r")][-1] == (4, "1 file(s) truncated")

    assert main(["ckpt", "gc", "--keep", "1", "--grace", "0", "--dry-run", "--store", store.url]) == 0
    shown = {line.split(":", 1)[0]: line for line in capsys.readouterr().out.splitlines() if " checkpoint r@" in line}
    assert "the newest whole checkpoint of its run" in shown["would keep checkpoint r@3"]
    assert "damaged (1 file(s) truncated), LATEST names it" in shown["would keep checkpoint r@4"]
    assert "older than the 1 newest whole checkpoint(s) kept (--keep 1)" in shown["would remove checkpoint r@1"]
    assert "damaged (1 file(s) truncated), a whole checkpoint newer than it is kept" in shown["would remove checkpoint r@2"]
    assert store.committed_steps("r") == [1, 2, 3, 4]  # a dry run removes nothing

    assert main(["ckpt", "gc", "--keep", "1", "--grace", "0", "--store", store.url]) == 0
    assert store.committed_steps("r") == [3, 4] and verify(store.checkpoint_url("r", 3), deep=True).ok


def test_a_damaged_checkpoint_never_counts_as_kept(store):
    """--keep 0 still keeps the newest whole checkpoint; a damaged one newer than every whole one
    is left for repair, LATEST stays, and only what a whole newer checkpoint replaces goes."""
    attempts = {step: write_checkpoint(store, "r", step)[1] for step in (1, 2, 3, 4, 5)}
    _truncate_a_shard(store, "r", 4, attempts[4])
    store.fs.rm_file(f"{store.root}/r/checkpoints/step-00000005/{attempts[5]}/rank-00000.safetensors")
    store.fs.pipe_file(f"{store.root}/r/LATEST", b"step-00000001")  # a resumed run forked from step 1
    report = collect(store, keep=2, grace_s=0)
    kept = {verdict.step: verdict.why for verdict in report.checkpoints if not verdict.remove}
    assert sorted(kept) == [1, 2, 3, 4, 5]  # every one kept, each with its own reason
    assert store.committed_steps("r") == [1, 2, 3, 4, 5]
    assert "LATEST names it" in kept[1] and "2 newest whole" in kept[2] and "newest whole checkpoint" in kept[3]
    assert "no whole checkpoint is newer" in kept[4] and "1 file(s) missing" in kept[5]
    collect(store, keep=0, grace_s=0)
    assert store.committed_steps("r") == [1, 3, 4, 5]


def test_every_request_denied_is_one_line_naming_the_call(s3_store, fault_proxy, capsys):
    """With every request answered 403 (issue 43), each catalog command ends in one line, exit 3,
    naming the call that was refused; nothing is retried (a 403 does not heal)."""
    write_checkpoint(Store(s3_store), "r", 1)
    fault_proxy.add("denied")
    for argv in (["ckpt", "ls"], ["ckpt", "ls", "--run", "r", "--all"], ["ckpt", "show", "r@1"], ["ckpt", "verify", "r"],
                 ["ckpt", "gc", "--keep", "1", "--dry-run"]):
        assert main([*argv, "--store", s3_store]) == 3, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("rayshard: error: storage request refused: PermissionError"), err
        assert re.search(r", in \w+\.\w+ \(`.*fs\.\w+\(", err), err  # the call: its function and its line
        assert "(`" in err and "policy" in err, err
    assert all(rule.injected for rule in fault_proxy.rules)


@pytest.mark.parametrize("fault", ["denied", "error500"])
def test_a_shard_read_the_store_refuses_is_a_storage_error_not_a_damaged_checkpoint(s3_store, fault_proxy, monkeypatch,
                                                                                    fault, capsys):
    """A 403 or a 500 on a shard's GET said "the shard is missing or truncated. Fix: restore the
    file" (digest, diff, export) or listed the file as damaged (verify --deep, exit 1): the store's
    refusal says nothing about the checkpoint. Exit 3, one line, nothing to restore."""
    monkeypatch.setenv("RAYSHARD_S3_MAX_ATTEMPTS", "1")
    write_checkpoint(Store(s3_store), "r", 1)
    fault_proxy.add(fault, method="GET", path=r"rank-00000\.safetensors")
    for argv, says in ((["ckpt", "digest", "r@1"], "which says nothing about the checkpoint"),
                       (["ckpt", "verify", "r@1", "--deep"], "so the checkpoint could not be verified")):
        assert main([*argv, "--store", s3_store]) == 3, argv
        err = capsys.readouterr().err.strip()
        assert says in err and "restore" not in err and "\n" not in err, err


def _full_disk_available() -> bool:
    import shutil
    import subprocess

    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _full_disk_available(), reason="needs `unshare -rm` to mount a small tmpfs")
def test_verify_runs_on_a_full_disk(tmp_path):
    """`ckpt verify` wrote its reader lease first, so on a full disk it could not check anything
    (issue 43): it now verifies without the lease, saying so in one warning line."""
    import subprocess
    import sys
    from pathlib import Path

    write_checkpoint(Store(str(tmp_path / "store")), "r", 1)
    disk = tmp_path / "disk"
    disk.mkdir()
    repo = Path(__file__).resolve().parents[2]
    # A real full file system: a 1 MiB tmpfs in a private mount namespace, the store copied in,
    # then filled to the last byte.
    script = (f"mount -t tmpfs -o size=1m tmpfs {disk} && cp -r {tmp_path / 'store'} {disk}/store && "
              f"(dd if=/dev/zero of={disk}/fill bs=4k 2>/dev/null; true) && "
              f"! sh -c 'echo x > {disk}/probe' 2>/dev/null && "
              f"{sys.executable} -m rayshard ckpt verify r@1 --deep --quiet --store {disk}/store")
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=repo, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok: ") and "read back and checksummed" in done.stdout, done.stdout
    [warning] = done.stderr.splitlines()
    assert "without a reader lease" in warning and "No space left on device" in warning, done.stderr


def test_a_missing_bucket_is_one_line_before_anything_starts(s3_store, monkeypatch, capsys):
    """A bucket that does not exist was found only at the first save, after s3fs had tried to
    create it (issue 43); `ckpt ls` said "no committed checkpoints". Now train, ls and gc name it
    in one line, exit 3, before Ray starts, and nothing creates it."""
    import boto3

    import rayshard.cluster.cli.commands.train as train_command

    def started(*_args, **_kwargs):
        raise AssertionError("training started on a store whose bucket does not exist")

    monkeypatch.setattr(train_command, "train", started)
    monkeypatch.setattr(train_command, "train_elastic", started)
    missing = f"rayshard-missing-{__import__('uuid').uuid4().hex[:12]}"
    for argv in (["train", "--steps", "1", "--run", "r"], ["train", "--elastic", "--steps", "1"], ["ckpt", "ls"],
                 ["ckpt", "gc", "--keep", "1"]):
        assert main([*argv, "--store", f"s3://{missing}/runs"]) == 3, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"its bucket {missing!r} does not exist" in err and "aws s3 mb" in err, err
    client = boto3.client("s3", endpoint_url=Store(s3_store).storage_conf["s3"]["endpoint_url"], region_name="us-east-1")
    assert missing not in {bucket["Name"] for bucket in client.list_buckets()["Buckets"]}
    assert main(["ckpt", "ls", "--store", s3_store]) == 0  # a bucket that exists, with nothing in it yet


def test_a_silent_store_ends_in_one_line_naming_the_call_and_its_bound(s3_store, fault_proxy, monkeypatch, capsys):
    """Every storage call of a catalog command has a bound (storage.call_timeout_s): with a store
    that accepts requests and never answers, each command stops at the first call's bound, in one
    line, exit 3, naming the call and the bound, where it waited for every retry to time out."""
    write_checkpoint(Store(s3_store), "r", 1)
    monkeypatch.setenv("RAYSHARD_S3_CALL_TIMEOUT_S", "2")
    fault_proxy.add("stall", seconds=8)
    for argv in (["ckpt", "ls"], ["ckpt", "show", "r@1"], ["ckpt", "gc", "--keep", "1", "--dry-run"]):
        assert main([*argv, "--store", s3_store]) == 3, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "storage request failed: StorageCallTimeout: " in err, err
        assert re.search(r"\w+\(.+\) got no answer within 2 s, retries included", err), err
        assert "RAYSHARD_S3_CALL_TIMEOUT_S" in err and re.search(r", in \w+\.\w+ \(`", err), err


def test_a_stalled_shard_read_ends_at_its_bound_as_a_storage_error(s3_store, fault_proxy, monkeypatch, capsys):
    """Shard reads had no bound of their own: s3fs retried a stalled range on top of the client's
    retries (204 s and 75 GETs for two ranges with 2 attempts of 2 s). Each range now has
    storage.stall_timeout_s, retries included, and the command ends in one line, exit 3."""
    write_checkpoint(Store(s3_store), "r", 1)
    monkeypatch.setenv("RAYSHARD_S3_STALL_TIMEOUT_S", "3")
    fault_proxy.add("stall", method="GET", path=r"rank-00000\.safetensors", seconds=20)
    assert main(["ckpt", "digest", "r@1", "--store", s3_store]) == 3
    err = capsys.readouterr().err.strip()
    assert "failed (TimeoutError: no bytes within 3 s, retries included" in err and "RAYSHARD_S3_STALL_TIMEOUT_S" in err, err
    assert "\n" not in err and "restore" not in err


def test_a_stalled_window_of_a_large_chunk_ends_at_its_bound(s3_store, fault_proxy, monkeypatch):
    """A chunk larger than the read window is read one window after another (verify --deep, and
    a load's large requests): each window had no bound of its own, only the client's retries. Now
    each is bounded like every range, by storage.stall_timeout_s, and fails as a storage error."""
    url, _ = write_checkpoint(Store(s3_store), "r", 1)
    monkeypatch.setenv("RAYSHARD_S3_STALL_TIMEOUT_S", "3")
    configure()  # as a command or a rank applies the environment's storage options
    try:
        fault_proxy.add("stall", method="GET", path=r"rank-00000\.safetensors", seconds=30)
        with pytest.raises(StoreUnavailable, match=r"no bytes within 3 s, retries included") as stalled:
            verify(url, deep=True, window_bytes=16)
        assert "\n" not in str(stalled.value)
        stored = StoredCheckpoint(url)
        target = Target("w", "param", (0, 0), (64, 4))
        with pytest.raises(StoreUnavailable, match=r"no bytes within 3 s, retries included") as stalled:
            stored.read({target: Destination(torch.empty(64, 4), (0, 0))}, window_bytes=16)
        assert "rank-00000.safetensors" in str(stalled.value)
    finally:
        monkeypatch.delenv("RAYSHARD_S3_STALL_TIMEOUT_S")
        configure()
