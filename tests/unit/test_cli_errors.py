"""The CLI turns bad input into one clear line on stderr and exit code 2, before starting Ray."""
import subprocess
import sys

import pytest

from rayshard.cluster.cli.main import main

BAD_TRAIN_ARGUMENTS = [
    (["--tp", "4"], "layout.tp=4: must divide the number of kv heads (2). Fix: use --tp in [1, 2]"),
    (["--dp", "2", "--tp", "2", "--world-size", "8"], "world_size=8: must equal dp*fsdp*tp*pp"),
    (["--seq-len", "0"], "seq_len=0: sequence length must be positive"),
    (["--model", "huge"], "unknown preset"),
    (["--config", "/nonexistent.yaml"], "file not found"),
    (["--lora-rank", "4", "--lora-targets", "q,qkv"], "names ['qkv']; the projections that exist are q,k,v,o,gate,up,down"),
    (["--lora-rank", "65", "--lora-targets", "q"], "lora.rank=65: exceeds target 'q''s dimension (64 in, 64 out)"),
]


def test_a_bad_argument_is_one_line_and_exit_2_from_the_real_command():
    """The process as a user meets it: `python -m rayshard` (its exit code, nothing but the line)."""
    args, fragment = BAD_TRAIN_ARGUMENTS[0]
    done = subprocess.run([sys.executable, "-m", "rayshard", "train", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"rayshard: error: {fragment}\n", done.stderr


@pytest.mark.parametrize("args, fragment", BAD_TRAIN_ARGUMENTS)
def test_bad_train_arguments_fail_fast_with_a_fix(args, fragment, capsys, monkeypatch):
    """In this process (a subprocess each costs a torch import): the same `main`, with training,
    which is what starts Ray, replaced by a failure, so an error found only after it would show."""
    import rayshard.cluster.cli.commands.train as train_command

    def started(*_args, **_kwargs):
        raise AssertionError("training started before the bad input was refused")

    monkeypatch.setattr(train_command, "train", started)
    monkeypatch.setattr(train_command, "train_elastic", started)
    assert main(["train", *args]) == 2
    stderr = capsys.readouterr().err
    assert stderr.startswith("rayshard: error: ") and stderr.count("\n") == 1, stderr
    assert fragment in stderr and "Traceback" not in stderr
