"""The one commit path (`Store.begin` -> PendingCheckpoint): shard names per rank, a commit that
makes the checkpoint visible and moves LATEST, and nothing visible from a save that never
commits, loses the race for its step, or wrote chunks that do not tile their tensor. Real local
and in-memory fsspec stores."""
from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

from rayshard.storage.manifest_io import read_manifest
from rayshard.actors.checkpoint.shard_writer import Piece, write_shard
from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.cluster.catalog.catalog import Catalog
from rayshard.cluster.catalog.store import Store
from rayshard.plans.errors import CheckpointError, StoreUnavailable

ROWS, COLS = 6, 3
METADATA = {"run": "r", "step": 4, "layout": {"dp": 1, "fsdp": 2, "tp": 1, "pp": 1}, "model_preset": "tiny"}


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path):
    return Store(str(tmp_path / "store") if request.param == "local" else f"memory://pending-{uuid.uuid4().hex}")


def _weight(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.25 + step  # asymmetric rows


def _write_ranks(pending, weight: torch.Tensor, rows_per_rank: tuple[int, ...] = (2, 4)) -> list:
    """Each 'rank' writes its row block of `weight` into its own file; returns their chunks."""
    fs, base = fsspec.core.url_to_fs(pending.url)
    chunks, start = [], 0
    for rank, rows in enumerate(rows_per_rank):
        piece = Piece("w", "param", weight[start:start + rows], (ROWS, COLS), (start, 0))
        chunks += write_shard(fs, base, pending.file_for(rank), [piece])
        start += rows
    return chunks


def test_ranks_write_their_own_files_under_one_attempt_and_the_commit_makes_them_visible(store):
    pending = store.begin("r", 4)
    assert pending.url == store.checkpoint_url("r", 4) and pending.attempt.startswith("attempt-")
    assert [pending.file_for(rank) for rank in (0, 3)] == [f"{pending.attempt}/rank-00000.safetensors",
                                                           f"{pending.attempt}/rank-00003.safetensors"]
    assert pending.file_for(1, stem="import") == f"{pending.attempt}/import-00001.safetensors"
    assert store.begin("r", 4).attempt != pending.attempt  # every save writes under its own prefix
    weight = _weight(4)
    chunks = _write_ranks(pending, weight)
    assert store.committed_steps("r") == [] and store.latest_step("r") is None  # written, not visible

    url = pending.commit(chunks, METADATA)

    assert url == pending.url and store.committed_steps("r") == [4] and store.latest_step("r") == 4
    assert store.resolve("r").url == url
    stored_chunks, metadata = read_manifest(url)
    assert sorted(c.file for c in stored_chunks) == [pending.file_for(0), pending.file_for(1)]
    assert metadata["step"] == 4 and metadata["format_version"] and metadata["model_preset"] == "tiny"
    assert torch.equal(StoredCheckpoint(url).read_region("w", "param", (0, 0), (ROWS, COLS)), weight)


def test_a_second_commit_of_the_same_step_is_refused_and_leaves_the_first(store):
    first = store.begin("r", 4)
    url = first.commit(_write_ranks(first, _weight(4)), METADATA)
    second = store.begin("r", 4)
    chunks = _write_ranks(second, _weight(40))
    with pytest.raises(CheckpointError, match="another writer committed this checkpoint first"):
        second.commit(chunks, METADATA)
    assert {c.file.split("/")[0] for c in read_manifest(url)[0]} == {first.attempt}
    assert store.latest_step("r") == 4
    assert torch.equal(StoredCheckpoint(url).read_region("w", "param", (0, 0), (ROWS, COLS)), _weight(4))
    assert [leftover.path.rsplit("/", 1)[-1] for leftover in Catalog(store).leftovers("r")] == [second.attempt]


def test_a_save_that_dies_before_its_commit_leaves_only_a_leftover(store):
    committed = store.begin("r", 2)
    committed.commit(_write_ranks(committed, _weight(2)), dict(METADATA, step=2))
    crashed = store.begin("r", 4)
    _write_ranks(crashed, _weight(4))  # every shard written, then the writer died: no commit

    assert store.committed_steps("r") == [2] and store.latest_step("r") == 2
    with pytest.raises(CheckpointError, match="no committed checkpoint at that step"):
        store.resolve("r@4")
    catalog = Catalog(store)
    assert [e.step for e in catalog.checkpoints("r")] == [2]
    assert [(leftover.step, leftover.path.rsplit("/", 1)[-1]) for leftover in catalog.leftovers("r")] == \
        [(4, crashed.attempt)]


@pytest.mark.parametrize("rows_per_rank, problem", [((2, 3), "chunks hold 15 elements"),
                                                    ((4, 4), "lies outside the global shape")])
def test_chunks_that_do_not_tile_their_tensor_are_never_committed(store, rows_per_rank, problem):
    pending = store.begin("r", 4)
    chunks = _write_ranks(pending, torch.zeros(8, COLS), rows_per_rank)
    with pytest.raises(CheckpointError, match=problem):
        pending.commit(chunks, METADATA)
    assert store.committed_steps("r") == [] and store.latest_step("r") is None


@pytest.mark.parametrize("damage, says", [("removed", "rank-00001.safetensors (missing)"),
                                           ("truncated", "rank-00001.safetensors (100 of ")])
def test_a_file_gone_or_cut_short_before_the_commit_is_never_committed(store, damage, says):
    """A `ckpt gc` that took a slow rank's attempt for a leftover removed a finished rank's file;
    the commit then named it in a manifest LATEST pointed at. The commit now lists the files first."""
    committed = store.begin("r", 2)
    committed.commit(_write_ranks(committed, _weight(2)), dict(METADATA, step=2))
    pending = store.begin("r", 4)
    chunks = _write_ranks(pending, _weight(4))
    fs, base = fsspec.core.url_to_fs(pending.url)
    victim = f"{base}/{pending.file_for(1)}"
    if damage == "removed":
        fs.rm(victim)
    else:
        fs.pipe_file(victim, fs.cat_file(victim)[:100])
    with pytest.raises(CheckpointError, match="not committed: 1 file") as refused:
        pending.commit(chunks, dict(METADATA, step=4))
    assert says in str(refused.value) and "\n" not in str(refused.value)
    assert store.committed_steps("r") == [2] and store.latest_step("r") == 2


@pytest.mark.parametrize("latest", [None, b"\xff\xfe\x00", b"garbage", b"step-00000099"])
def test_a_missing_or_damaged_latest_resolves_to_the_newest_committed_step(store, capsys, latest):
    """A manifest is written last, so every committed step is whole: with LATEST gone (a crash
    between the first manifest and LATEST) or damaged, `latest` is the newest committed step and
    a warning says so; the next commit writes LATEST again."""
    for step in (4, 6):
        pending = store.begin("r", step)
        pending.commit(_write_ranks(pending, _weight(step)), dict(METADATA, step=step))
    fs, root = fsspec.core.url_to_fs(store.url)
    if latest is None:
        fs.rm(f"{root}/r/LATEST")
    else:
        fs.pipe_file(f"{root}/r/LATEST", latest)
    assert store.resolve("latest", current_run="r").url == store.checkpoint_url("r", 6)
    assert "its LATEST pointer" in capsys.readouterr().err
    pending = store.begin("r", 8)
    pending.commit(_write_ranks(pending, _weight(8)), dict(METADATA, step=8))
    assert store.latest_step("r") == 8 and store.resolve("r").url == store.checkpoint_url("r", 8)


@pytest.mark.parametrize("ref", ["r@²", "r@٢", "r@2x", "r@-2"])
def test_a_step_that_is_not_ascii_digits_is_refused_in_one_line(store, ref):
    """'²' reached int() (a traceback) and '٢' was read as step 2."""
    committed = store.begin("r", 2)
    committed.commit(_write_ranks(committed, _weight(2)), dict(METADATA, step=2))
    with pytest.raises(CheckpointError, match="the step after '@' must be a number"):
        store.resolve(ref)


def test_latest_without_a_current_run_says_how_to_name_the_checkpoint(store):
    with pytest.raises(CheckpointError, match=r"no current run here. Fix: address the checkpoint as RUN \(its newest\)"):
        store.resolve("latest")


def test_a_store_that_fails_latests_swap_says_the_checkpoint_is_committed(store, monkeypatch):
    """The manifest was created, then the store failed LATEST's write: the caller got the store's
    bare OSError, and a retry then "already committed". The error now says the step is committed."""
    committed = store.begin("r", 2)
    committed.commit(_write_ranks(committed, _weight(2)), dict(METADATA, step=2))
    pending = store.begin("r", 4)
    chunks = _write_ranks(pending, _weight(4))

    def failing(path, data, token):
        raise OSError(121, "We encountered an internal error. Please try again.")

    monkeypatch.setattr(store.backend, "replace_if", failing)
    with pytest.raises(StoreUnavailable, match=r"r@4 is committed \(.*\), but moving LATEST to it failed \(OSError: .*\), "
                                               r"so LATEST still names step 2. Fix: address this one as r@4"):
        pending.commit(chunks, dict(METADATA, step=4))
    assert store.committed_steps("r") == [2, 4] and store.latest_step("r") == 2
