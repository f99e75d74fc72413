"""Counts, amounts, run names and file names on the command line are checked while the
arguments are parsed: a zero block size, a NaN memory budget, a negative grace or a run name
that would write outside the store fails naming the flag, exit 2."""
import pytest

from rayshard.cluster.cli.main import main


@pytest.mark.parametrize("argv, message", [
    (["plan", "layout", "--ranks", "8", "--microbatches", "0"], "argument --microbatches: must be >= 1, got 0"),
    (["plan", "layout", "--ranks", "x"], "argument --ranks: must be a whole number >= 1, got 'x'"),
    (["plan", "layout", "--ranks", "8", "--memory-gib", "nan"], "argument --memory-gib: must be a finite number > 0, got nan"),
    (["plan", "layout", "--ranks", "8", "--tp", "0"], "argument --tp: must be >= 1, got 0"),
    (["ckpt", "digest", "run", "--block-mib", "0"], "argument --block-mib: must be a finite number > 0, got 0"),
    (["ckpt", "export", "run", "--out", "d", "--max-shard-mib", "-1"], "argument --max-shard-mib: must be a finite number > 0"),
    (["ckpt", "gc", "--keep", "-1"], "argument --keep: must be >= 0, got -1"),
    (["ckpt", "gc", "--keep", "1", "--grace", "inf"], "argument --grace: must be a finite number >= 0, got inf"),
    (["plan", "layers", "--layers", "0", "--pp", "2"], "argument --layers: must be >= 1, got 0"),
    (["train", "--elastic", "--max-failures", "-2"], "argument --max-failures: must be >= 0, got -2"),
    (["plan", "schedule", "--pp", "2", "-m", "10000000"], "argument --microbatches/-m: must be <= 1024"),
    (["plan", "layers", "--layers", "8", "--pp", "1000000000"], "argument --pp: must be <= 256"),
    (["ckpt", "import", "hf-dir", "--run", "../escape"], "argument --run: '../escape' is not a run name"),
    (["ckpt", "reshard", "src", "--to", "tp=2", "--run", "a/b"], "argument --run: 'a/b' is not a run name"),
    (["ckpt", "import", "hf-dir", "--run", ""], "argument --run: '' is not a run name"),
    (["ckpt", "plot-resume", "--run", "r", "--out", "picture.txt"], "argument --out: 'picture.txt' does not end in .png"),
    (["ckpt", "plan", "r", "--to", "pp=2", "--stage-layout", "1,x"], "argument --stage-layout: '1,x' is not comma-separated"),
])
def test_an_out_of_range_number_is_named_at_parse_time(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_numbers_in_range_parse_as_numbers(capsys):
    assert main(["plan", "layout", "--ranks", "4", "--memory-gib", "1e3", "--model", "tiny", "--microbatches", "1"]) == 0
    assert "of 1000.00 GiB budget" in capsys.readouterr().out
