"""A real `ray start --head` and `ray job submit --working-dir . -- python -m cluster train`.

The head runs in its own session directory and process group and is torn down by killing that
group — never `ray stop`, which would also stop the test session's own Ray instance.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def ray_head():
    # Ray's socket paths must stay under 107 bytes, so its session dir gets a short name.
    temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    bin_dir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RAY_AUTH_MODE="token",
               RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    gcs_port, dashboard_port = _free_port(), _free_port()
    head = subprocess.Popen(
        [f"{bin_dir}/ray", "start", "--head", "--block", f"--port={gcs_port}", "--num-cpus=4",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        probe = subprocess.run([f"{bin_dir}/ray", "job", "list", "--address", address], env=env,
                               capture_output=True, text=True)
        if probe.returncode == 0:
            break
        if head.poll() is not None:
            pytest.fail(f"ray start exited early:\n{head.stdout.read()}")
        time.sleep(2)
    else:
        pytest.fail("the Ray dashboard did not come up within 120 s")
    yield address, env
    os.killpg(head.pid, signal.SIGTERM)
    try:
        head.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(head.pid, signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_trains_and_commits_a_checkpoint(ray_head, tmp_path):
    address, env = ray_head
    store = tmp_path / "store"
    submit = subprocess.run(
        [f"{os.path.dirname(sys.executable)}/ray", "job", "submit", "--address", address, "--working-dir", ".",
         "--", "python", "-m", "cluster", "train", "--steps", "3", "--dp", "2", "--tp", "1",
         "--global-batch", "4", "--seq-len", "32", "--store", str(store), "--run", "job"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
    output = submit.stdout + submit.stderr
    assert submit.returncode == 0, output
    assert "succeeded" in output and "step     3/3" in output, output
    assert (store / "job" / "checkpoints" / "step-00000003" / "manifest.parquet").exists()
    assert (store / "job" / "LATEST").read_text() == "step-00000003"
