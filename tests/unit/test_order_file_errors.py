"""A pipeline order from a file that cannot run is refused before any rank starts, naming the file
(the run's config keeps only the file's cells, so errors found after parsing used to say "schedule
CSV")."""
from __future__ import annotations

import csv

from rayshard.cluster.cli.main import main
from rayshard.plans.pipeline.csv_order import parse_pipeline_csv
from rayshard.plans.pipeline.plan import check_order_file


def _write(path, rows) -> str:
    with open(path, "w", newline="") as handle:
        csv.writer(handle).writerows(rows)
    return str(path)


def _train_error(capsys, path) -> str:
    # Refused in the CLI's validation: no Ray, no ranks (a run would need a store and actors).
    assert main(["train", "--schedule-csv", path, "--store", str(path) + ".store", "--run", "x"]) == 2
    return capsys.readouterr().err


def test_a_deadlock_names_the_file_and_the_waiting_actions(tmp_path, capsys):
    path = _write(tmp_path / "backwards_first.csv", [["0F0", "0B0"], ["1B0", "1F0"]])
    error = _train_error(capsys, path)
    assert error.startswith(f"rayshard: error: {path}: ")
    assert "rank 1 at step 0: B(stage=1, mb=0)" in error and "rank 0 at step 1: B(stage=0, mb=0)" in error


def test_a_transfer_with_no_peer_names_the_file(tmp_path, capsys):
    rows = [["0F0", "0SEND_F0", "0RECV_B0", "0B0"], ["1RECV_F0", "1F0", "1SEND_F0", "1B0", "1SEND_B0"]]
    path = _write(tmp_path / "extra_send.csv", rows)
    error = _train_error(capsys, path)
    assert f"{path}: rank 1 has SEND_F for stage 1, but no stage is on the other end" in error


def test_a_sound_file_passes_the_same_check():
    check_order_file(parse_pipeline_csv([["0F0", "0B0"], ["1F0", "1B0"]], "sound.csv"))
