"""The run's note of its newest snapshot in memory, and `ckpt ls` showing it (issue 41 item 4)."""
import time

from rayshard.cluster.catalog.snapshot_record import (RECORD, describe_snapshot_record, read_snapshot_record,
                                                      write_snapshot_record)
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.cli.main import main


def test_the_note_round_trips_and_a_damaged_one_reads_as_none(tmp_path):
    store = Store(str(tmp_path / "store"))
    assert read_snapshot_record(store, "run") is None
    write_snapshot_record(store, "run", 41, 1000.0, ["node-b", "node-a"])
    assert read_snapshot_record(store, "run") == {"step": 41, "taken_unix": 1000.0, "nodes": ["node-a", "node-b"]}
    (tmp_path / "store" / "run" / RECORD).write_text("{not json")
    assert read_snapshot_record(store, "run") is None
    (tmp_path / "store" / "run" / RECORD).write_text('{"step": "41"}')
    assert read_snapshot_record(store, "run") is None


def test_the_line_names_the_step_its_age_and_where_the_copies_are():
    line = describe_snapshot_record("run", {"step": 7, "taken_unix": 100.0, "nodes": ["0123456789abcdef", "fedcba"]},
                                    now=112.0)
    assert line == ("snapshot in memory: run@7, taken 12 s ago, copies on 0123456789ab, fedcba "
                    "(not durable: kept by the job's snapshot keepers while it runs)")


def test_ckpt_ls_shows_the_snapshot_of_a_run_without_checkpoints_yet(tmp_path, capsys):
    store = Store(str(tmp_path / "store"))
    write_snapshot_record(store, "hot", 3, time.time(), ["node-a", "node-b"])
    assert main(["ckpt", "ls", "--store", store.url, "--run", "hot"]) == 0
    out = capsys.readouterr().out
    assert "no committed checkpoints in run 'hot'" in out
    assert "snapshot in memory: hot@3, taken " in out and "copies on node-a, node-b" in out
