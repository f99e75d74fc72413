"""A snapshot whose every rank's write had ended when the attempt failed is committed then, not
abandoned (issue 41, at most one step redone; docs/decisions.md 207).

A snapshot is committed once every rank's write to the keepers has ended; the driver notices at
its next step's poll. A failure ends the attempt before that poll, so a snapshot written whole
just before a failure used to be lost and the run resumed one snapshot further back. Here two
stand-in ranks (real Ray actors writing real shard files to the keepers through the shard writer;
the thing under test is the driver's `Snapshots` / `AsyncCheckpointer`) write step 1 whole, then
step 2, which one of them never finishes before it is killed. `settle` must commit step 1, the
restart must choose it, and a snapshot with a failed write must not be committed.
"""
import threading
import uuid
from types import SimpleNamespace

import pytest
import torch


def _stand_in_rank_class():
    """Defined in a function: Ray ships a local class by value (a test module is not importable
    in the workers)."""

    class _StandInRank:
        """A rank's part in a background snapshot: stage_save writes its half of one tensor at once
        (or, when told, never says that it finished), save_finished answers as the rank's does."""

        def __init__(self, rank: int):
            self.rank, self.replies, self.never, self.fail = rank, {}, set(), set()
            self.changed = threading.Condition()

        def hold(self, url_suffix: str, how: str) -> None:
            (self.never if how == "never" else self.fail).add(url_suffix)

        def stage_save(self, checkpoint_url: str, file: str) -> dict:
            import fsspec

            import rayshard.actors.snapshot.filesystem  # noqa: F401  (serves the scheme here)
            from rayshard.actors.checkpoint.shard_writer import Piece, write_shard
            from rayshard.plans.checkpoint.chunk_table import ChunkTable

            step = int(checkpoint_url.rsplit("step-", 1)[1])
            whole = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3) * (step + 0.5) - 7  # asymmetric per row and step
            half = whole[4 * self.rank: 4 * self.rank + 4].clone()
            if any(checkpoint_url.endswith(s) for s in self.never):
                return {"bytes": 0, "seconds": 0.0}
            if any(checkpoint_url.endswith(s) for s in self.fail):
                reply = {"done": True, "rows": None, "error": f"rank {self.rank}: the keeper refused it"}
            else:
                fs, base = fsspec.core.url_to_fs(checkpoint_url)
                rows = ChunkTable.from_chunks(write_shard(fs, base, file, [Piece("w", "param", half, (8, 3), (4 * self.rank, 0))]))
                reply = {"done": True, "rows": rows, "error": None}
            with self.changed:
                self.replies[checkpoint_url] = {**reply, "copy_seconds": 0.0, "upload_seconds": 0.0,
                                                "optimizer_wait_seconds": 0.0}
                self.changed.notify_all()
            return {"bytes": half.numel() * 4, "seconds": 0.0}

        def save_finished(self, checkpoint_url: str, timeout_s: float) -> dict | None:
            with self.changed:
                self.changed.wait_for(lambda: checkpoint_url in self.replies, timeout_s)
                return self.replies.get(checkpoint_url)

    return _StandInRank


@pytest.fixture
def stand_ins(ray_session):
    """Two stand-in ranks; afterwards, the keepers the test's `Snapshots` started are stopped, so
    later tests of the session's Ray see only the keepers they start themselves."""
    from rayshard.actors.snapshot import keepers

    before = dict(keepers._STARTED)
    ranks = [ray_session.remote(_stand_in_rank_class()).options(num_cpus=0, max_concurrency=4).remote(rank) for rank in range(2)]
    yield ranks
    for rank in ranks:
        ray_session.kill(rank)
    for node in [node for node in keepers._STARTED if node not in before]:
        ray_session.kill(keepers._STARTED.pop(node))


def _snapshots(ranks):
    from rayshard.cluster.run.snapshots import Snapshots

    snapshots = Snapshots(f"/tmp/durable-{uuid.uuid4().hex[:8]}", "run", every=1)
    group = SimpleNamespace(actors=ranks, call_timeout_s=60.0)
    snapshots.in_background(group, len(ranks), lambda step, parent: {"step": step, "run": "run", "parent": parent})
    return snapshots


def _wait_until_written(ray, snapshots, index: int) -> None:
    finished = snapshots.background.pending[index].finished
    ray.wait(finished, num_returns=len(finished), timeout=60)


def test_a_snapshot_written_whole_before_a_rank_died_is_committed_as_the_attempt_ends(ray_session, stand_ins):
    from rayshard.storage.manifest_io import read_manifest

    snapshots = _snapshots(stand_ins)
    snapshots.start(1, None)
    _wait_until_written(ray_session, snapshots, 0)  # whole, but no step's poll has seen it yet
    ray_session.get(stand_ins[1].hold.remote("step-00000002", "never"), timeout=60)
    snapshots.start(2, None)  # rank 1 dies before its write of step 2 ends
    ray_session.kill(stand_ins[1])
    snapshots.settle()
    choice = snapshots.choose(durable_step=None)
    assert choice.ref is not None and choice.ref.step == 1, choice.why
    chunks, metadata = read_manifest(choice.ref.url)
    assert metadata["step"] == 1 and len(chunks) == 2  # both ranks' halves, the dead rank's included
    assert snapshots.latest[0] == 1 and not snapshots.background.pending
    # The restart redoes step 2: the failed attempt's uncommitted write of it (rank 0's file)
    # holds memory in the keepers until it is dropped, committed or not.
    step_2 = f"{snapshots.store.root}/run/checkpoints/step-00000002"
    assert snapshots.store.fs.find(step_2)
    snapshots.forget_after(1)
    assert not snapshots.store.fs.find(step_2)


def test_a_snapshot_with_a_failed_write_is_not_committed_and_the_older_whole_one_is(ray_session, stand_ins):
    snapshots = _snapshots(stand_ins)
    snapshots.start(1, None)
    _wait_until_written(ray_session, snapshots, 0)
    ray_session.get(stand_ins[0].hold.remote("step-00000002", "fail"), timeout=60)
    snapshots.start(2, None)
    _wait_until_written(ray_session, snapshots, 1)  # every rank answered; one of them failed
    snapshots.settle()
    assert snapshots.choose(durable_step=None).ref.step == 1


def test_a_trainer_that_lost_the_run_commits_nothing_more_as_it_ends(ray_session, stand_ins, tmp_path):
    """Another trainer holds the run's writer lease (and may snapshot the run itself): the whole
    snapshot this one finished is not committed at settle, and no note goes to the durable store."""
    from rayshard.cluster.catalog.snapshot_record import read_snapshot_record
    from rayshard.cluster.catalog.store import Store

    snapshots = _snapshots(stand_ins)
    snapshots.durable = Store(str(tmp_path / "durable"))
    snapshots.start(1, None)
    _wait_until_written(ray_session, snapshots, 0)  # whole: a trainer that still held the run would commit it
    snapshots.settle(lost_run=True)
    assert snapshots.choose(durable_step=None).ref is None
    assert snapshots.latest is None and read_snapshot_record(snapshots.durable, "run") is None
    snapshots.taken(1, 0.0)  # a commit that was already running ends: still no note
    assert read_snapshot_record(snapshots.durable, "run") is None
