"""A local Ray that does not come up in time (a loaded machine) ends the command in one line
naming the fix, not Ray's traceback. The start is made to time out for real: Ray's own wait for
its new GCS is set to zero seconds, in a fresh process with no RAY_ADDRESS."""
from __future__ import annotations

import os
import subprocess
import sys


def test_a_local_ray_that_does_not_start_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_gcs_server_port_wait_time_s="0", RAY_AUTH_MODE="token")
    done = subprocess.run([sys.executable, "-m", "rayshard", "train", "--store", str(tmp_path / "store"), "--run", "r",
                           "--steps", "1", "--model", "tiny"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    errors = [line for line in done.stderr.splitlines() if line.startswith("rayshard: error:")]
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(errors) == 1 and "a local Ray could not be started" in errors[0] and "--start-timeout" in errors[0], done.stderr
    assert "Traceback" not in done.stderr
