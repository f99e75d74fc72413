"""`plan schedule --costs-from` on a run that trained a pipeline order read from a file.

Such a run's timings carry the schedule name "csv", which names no schedule to rebuild: before,
the command failed looking it up; now it says to pass the file, or replays the file's order with
the run's measured costs."""
from __future__ import annotations

import csv
import json

from rayshard.cluster.cli.main import main
from rayshard.plans.pipeline.csv_order import parse_pipeline_csv, schedule_of

# 1F1B on 2 ranks, 2 microbatches, as torch's compute-only CSV.
ROWS = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]


def _file_run(tmp_path):
    with open(tmp_path / "order.csv", "w", newline="") as handle:
        csv.writer(handle).writerows(ROWS)
    order = schedule_of(parse_pipeline_csv(ROWS))
    cost = {"F": 0.01, "B": 0.03}  # stage 1 is measured slower below, so the means are not uniform
    actions = [[a.kind.value, a.stage, a.microbatch, cost[a.kind.value] * (1 + a.stage)]
               for actions in order.ranks for a in actions if a.kind.value in cost]
    record = {"schedule": "csv", "layout": {"pp": 2, "vpp": 1}, "microbatches": 2,
              "median_plan_seconds": 0.3, "median_step_seconds": 0.35, "actions": actions}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "pipeline_timings.json").write_text(json.dumps(record))


def test_without_a_schedule_it_asks_for_the_file(tmp_path, capsys):
    _file_run(tmp_path)
    assert main(["plan", "schedule", "--costs-from", "run", "--store", str(tmp_path), "--no-grid"]) == 2
    error = capsys.readouterr().err
    assert "trained a pipeline order read from a file (--schedule-csv)" in error
    assert "pass that file with --from-csv" in error


def test_a_named_schedule_uses_the_runs_per_stage_means(tmp_path, capsys):
    _file_run(tmp_path)
    assert main(["plan", "schedule", "--costs-from", "run", "--store", str(tmp_path), "--schedule", "gpipe",
                 "--no-grid"]) == 0
    out = capsys.readouterr().out
    assert "costs measured by csv pp=2 vpp=1 m=2" in out and "per-stage means" in out
    assert "stage 0: F=0.01 B=0.03" in out


def test_the_file_replays_with_the_runs_costs(tmp_path, capsys):
    _file_run(tmp_path)
    assert main(["plan", "schedule", "--from-csv", str(tmp_path / "order.csv"), "--costs-from", "run",
                 "--store", str(tmp_path), "--no-grid"]) == 0
    out = capsys.readouterr().out
    assert "costs measured by csv pp=2 vpp=1 m=2" in out
    # Stage 0: F 10 ms, B 30 ms; stage 1: F 20 ms, B 60 ms. 1F1B, 2 microbatches on 2 ranks:
    # F0(0..10) F1(10..20) on rank 0; rank 1 F0 10..30, B0 30..90; rank 0 B0 90..120, then
    # rank 1 F1 90..110 (received at 20), B1 110..170; rank 0 B1 170..200: 0.2 s.
    assert "step time 0.2 " in out
