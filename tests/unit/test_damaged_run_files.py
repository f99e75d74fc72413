"""A run's own files and the command line's file arguments, damaged: named in one line (exit 2)
or, for the logs that only record history, skipped with a warning so a resume never stops on
them. Real files and the real CLI entry point."""
from __future__ import annotations

import json

import pytest

from rayshard.cluster.cli.main import main
from rayshard.cluster.pictures.resume_plot import read_metrics
from rayshard.cluster.run.metrics_sinks import open_sinks, read_metrics as read_run_metrics
from rayshard.cluster.catalog.store import Store
from rayshard.plans.config import TrainConfig
from rayshard.plans.errors import CheckpointError

GOOD = [{"step": 1, "loss": 5.5, "layout": "dp=2"}, {"step": 2, "loss": 5.25, "layout": "dp=2"},
        {"step": 3, "loss": 5.0, "layout": "dp=2"}]


def _write_metrics(store: Store, tail: str) -> None:
    store.write_text("r/metrics.jsonl", "\n".join(json.dumps(r) for r in GOOD) + "\n" + tail)


@pytest.mark.parametrize("tail", ['{"step": 4, "lo', "[1, 2]\n", "\xff garbage\n"])
def test_a_resume_keeps_the_readable_history_past_a_damaged_line(tmp_path, capsys, tail):
    store = Store(str(tmp_path))
    _write_metrics(store, tail if tail.endswith("\n") else tail + "\n")
    log = open_sinks(TrainConfig(store=str(tmp_path), run="r"), store, 2)[0]
    log.append({"step": 3, "loss": 4.0})  # resumed at step 2: step 3 again
    log.close()
    assert [(r["step"], r["loss"]) for r in read_run_metrics(store, "r")] == [(1, 5.5), (2, 5.25), (3, 4.0)]
    assert "skipped 1 line(s) that are not JSON records (line 4)" in capsys.readouterr().err


def test_the_picture_reads_around_a_damaged_line_and_refuses_a_file_with_no_steps(tmp_path, capsys):
    store = Store(str(tmp_path))
    _write_metrics(store, '{"step": "x", "loss": 1}\nnot json\n')
    assert [r["step"] for r in read_metrics(store, "r")] == [1, 2, 3]
    assert "skipped 1 line(s)" in capsys.readouterr().err
    store.write_text("q/metrics.jsonl", "nonsense\n")
    with pytest.raises(CheckpointError, match="holds no step records with a loss"):
        read_metrics(store, "q")


def _cli(argv, capsys) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_url_scheme_nobody_serves_is_one_line(tmp_path, capsys):
    code, err = _cli(["ckpt", "ls", "--store", "nosuchscheme://bucket/runs"], capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("rayshard: error: a URL's scheme is not served here (Protocol not known: nosuchscheme)")


def test_damaged_schedule_inputs_are_one_line(tmp_path, capsys):
    binary = tmp_path / "order.csv"
    binary.write_bytes(b"\xff\xfe0F0")
    code, err = _cli(["plan", "schedule", "--from-csv", str(binary)], capsys)
    assert code == 2 and len(err) == 1 and "is not a readable CSV text file" in err[0]
    for content, fragment in (("{'a': 1}", "is not valid JSON"), ("[]", "is not a pipeline timings record"),
                              ('{"layout": {"pp": 2}}', "lacks or garbles a field the timings need")):
        timings = tmp_path / "pipeline_timings.json"
        timings.write_text(content)
        code, err = _cli(["plan", "schedule", "--costs-from", str(timings)], capsys)
        assert code == 2 and len(err) == 1 and fragment in err[0], err


def test_a_local_path_in_the_way_is_the_users_input_not_a_storage_failure(tmp_path, capsys):
    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("x")
    code, err = _cli(["plan", "schedule", "--pp", "2", "-m", "4", "--schedule", "1f1b", "--json", str(tmp_path)], capsys)
    assert code == 2 and len(err) == 1 and f"{tmp_path}: Is a directory. Fix: pass a path that is free" in err[0]
