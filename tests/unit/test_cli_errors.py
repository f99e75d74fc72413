"""The CLI turns bad input into one clear line on stderr and exit code 2, before starting Ray."""
import subprocess
import sys

import pytest


@pytest.mark.parametrize("args, fragment", [
    (["--tp", "4"], "layout.tp=4: must divide the number of kv heads (2). Fix: use --tp in [1, 2]"),
    (["--dp", "2", "--tp", "2", "--world-size", "8"], "world_size=8: must equal dp*fsdp*tp*pp"),
    (["--seq-len", "0"], "seq_len=0: sequence length must be positive"),
    (["--model", "huge"], "unknown preset"),
    (["--config", "/nonexistent.yaml"], "file not found"),
])
def test_bad_train_arguments_fail_fast_with_a_fix(args, fragment):
    done = subprocess.run([sys.executable, "-m", "cluster", "train", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert fragment in done.stderr and "Traceback" not in done.stderr
