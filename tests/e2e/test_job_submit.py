"""A real `ray start --head` and `ray job submit --working-dir . -- python -m rayshard train`.

The head runs in its own session directory and process group and is torn down by killing that
group — never `ray stop`, which would also stop the test session's own Ray instance.
"""
import json
import os
import re
import shutil
import signal
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.built_wheel import build_wheel, unpack
from tests.free_port import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ray_head():
    # Ray's socket paths must stay under 107 bytes, so its session dir gets a short name.
    temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    bin_dir = os.path.dirname(sys.executable)
    # `ray start` never creates a token (only a local ray.init does), so on a fresh machine with no
    # ~/.ray/auth_token it refuses to start; the cluster gets its own, as a real deployment would.
    token_path = os.path.join(temp_dir, "auth_token")
    with open(token_path, "w") as handle:
        handle.write(secrets.token_hex(32))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN_PATH=token_path, RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("RAY_ADDRESS", None)
    gcs_port, dashboard_port = free_port(), free_port()
    # Every agent gets a free port: the defaults (52365, ...) collide with any other Ray on the
    # machine, and a job agent that cannot bind answers "No available agent to submit job".
    agent_ports = [f"--{flag}={free_port()}" for flag in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
        "ray-client-server-port")]
    head = subprocess.Popen(
        [f"{bin_dir}/ray", "start", "--head", "--block", f"--port={gcs_port}", "--num-cpus=8",
         "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}",
         *agent_ports, f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        # Its own directory as the working one: a job without --working-dir starts there, and the
        # checkout's rayshard/ in it would shadow what the job is meant to import.
        cwd=temp_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True)
    address = f"http://127.0.0.1:{dashboard_port}"
    try:
        _wait_until_jobs_run(head, bin_dir, address, env)
        yield address, env, f"127.0.0.1:{gcs_port}"
    finally:  # also when start-up failed: a leaked head would slow every later test
        # SIGTERM to `ray start` alone: it drains the node through the GCS, then stops its children
        # (~2 s). Sent to the whole group, the GCS died first and the drain waited out its 30 s.
        try:
            os.kill(head.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass  # `ray start` already exited (a start-up that failed): its group is killed below
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass  # the drain hung: everything goes below
        try:  # whatever outlived `ray start`
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def _wait_until_jobs_run(head, bin_dir, address, env, timeout=300):
    """Generous: on a loaded 2-core machine the job agent starts slowly."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        # Ready means a job can run: the dashboard answers `job list` before its agent accepts jobs.
        probe = subprocess.run([f"{bin_dir}/ray", "job", "submit", "--address", address, "--", "python", "-c", "pass"],
                               env=env, capture_output=True, text=True)
        if probe.returncode == 0:
            return
        if head.poll() is not None:
            pytest.fail(f"ray start exited early:\n{head.stdout.read()}")
        time.sleep(2)
    pytest.fail(f"the Ray job agent did not accept a job within {timeout} s; last answer:\n{probe.stdout[-2000:]}{probe.stderr[-2000:]}")


def test_ray_job_submit_trains_commits_and_a_resubmission_resumes(ray_head, tmp_path):
    """Two `ray job submit`s of one run name with `--resume auto`: the first starts fresh on dp2,
    the second (more steps, on one rank) resumes the first one's LATEST."""
    address, env, _ = ray_head
    store = tmp_path / "store"

    def submit(steps: int, dp: int) -> str:
        done = subprocess.run(
            [f"{os.path.dirname(sys.executable)}/ray", "job", "submit", "--address", address, "--working-dir", ".",
             "--", "python", "-m", "rayshard", "train", "--steps", str(steps), "--dp", str(dp), "--tp", "1",
             "--global-batch", "4", "--seq-len", "32", "--store", str(store), "--run", "job", "--resume", "auto"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=480)
        output = done.stdout + done.stderr
        assert done.returncode == 0, output
        assert "succeeded" in output, output
        return output

    first = submit(3, 2)
    assert "step     3/3" in first and "resuming from" not in first, first
    assert (store / "job" / "checkpoints" / "step-00000003" / "manifest.parquet").exists()
    assert (store / "job" / "LATEST").read_text() == "step-00000003"
    second = submit(5, 1)
    assert re.search(r"resuming from \S+/job/checkpoints/step-00000003 \(step 3, written by layout", second), second
    assert "step     4/5" in second and "step     5/5" in second and "step     1/5" not in second, second
    assert (store / "job" / "LATEST").read_text() == "step-00000005"


@pytest.mark.slow  # decision 113: the default suite's 15 minutes
def test_ray_job_submit_runs_rayshard_from_an_installed_wheel(ray_head, tmp_path):
    """No working directory: the job (driver and rank actors) imports rayshard from a wheel's files
    on PYTHONPATH, as a cluster whose image pip-installed the wheel would, and finds its embedded
    default config inside the package."""
    address, env, _ = ray_head
    site = unpack(build_wheel(tmp_path / "build"), tmp_path / "site")
    store = tmp_path / "store"
    where = "import rayshard.cluster.cli.train as t; print('RAYSHARD FROM', t.__file__, t.DEFAULT_CONFIG)"
    entrypoint = (f"python -c \"{where}\" && python -m rayshard train --steps 2 --dp 2 --tp 1 --global-batch 4 "
                  f"--seq-len 32 --store {store} --run wheel")
    done = _ray("job", "submit", "--address", address, "--runtime-env-json",
                json.dumps({"env_vars": {"PYTHONPATH": str(site)}}), "--", "sh", "-c", entrypoint,
                cwd=tmp_path, env=env, timeout=480)
    output = done.stdout + done.stderr
    assert done.returncode == 0 and "succeeded" in output, output
    module_file, default_config = re.search(r"RAYSHARD FROM (\S+) (\S+)", output).groups()
    assert module_file.startswith(str(site)) and default_config.startswith(str(site)), output
    assert (store / "wheel" / "LATEST").read_text() == "step-00000002"


def _ray(*args, env, **kwargs):
    return subprocess.run([f"{os.path.dirname(sys.executable)}/ray", *args], env=env, capture_output=True, text=True, **kwargs)


def _latest(store: Path, run: str) -> int:
    path = store / run / "LATEST"
    return int(path.read_text().split("-")[1]) if path.exists() else 0


def _wait_for_checkpoint(store: Path, run: str, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while _latest(store, run) < step:
        assert time.time() < deadline, f"no checkpoint at step {step} of {run} within {timeout}s"
        time.sleep(0.5)


def _losses(store: Path, run: str) -> dict[int, float]:
    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.run.metrics_sinks import read_metrics

    return {record["step"]: record["loss"] for record in read_metrics(Store(str(store)), run)}


# Enough steps that a stop or kill (polled every 0.5 s) lands before the run could finish on its own.
STEPS = 24
TRAIN = ["python", "-m", "rayshard", "train", "--steps", str(STEPS), "--ckpt-every", "2", "--global-batch", "8",
         "--seq-len", "32", "--tp", "1", "--warmup-steps", "3", "--resume", "auto", "--verify-resume"]


def _resume_checks(store: Path, run: str) -> list[dict]:
    """What --verify-resume recorded: the resumed state's digests against the checkpoint's."""
    import json

    return [json.loads(line) for line in (store / run / "resume-checks.jsonl").read_text().splitlines() if line]


@pytest.mark.slow
def test_stopped_job_resubmitted_on_fewer_ranks_continues_the_losses(ray_head, tmp_path, run_training):
    address, env, _ = ray_head
    store = tmp_path / "store"
    common = ["--store", str(store), "--run", "resub"]
    submitted = _ray("job", "submit", "--address", address, "--no-wait", "--working-dir", ".", "--",
                     *TRAIN, "--dp", "8", *common, cwd=REPO, env=env, timeout=120)
    assert submitted.returncode == 0, submitted.stdout + submitted.stderr
    # The CLI may colour its output (ANSI escapes around the id), so match the id's own characters.
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", submitted.stdout).group(0)
    _wait_for_checkpoint(store, "resub", 2)
    # Without --no-wait, `ray job stop` returns once the job has exited.
    stopped = _ray("job", "stop", "--address", address, job_id, env=env, timeout=300)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    stopped_at = _latest(store, "resub")
    assert stopped_at < STEPS, "the job finished before it could be stopped"
    status = _ray("job", "status", "--address", address, job_id, env=env, timeout=120)
    assert "was stopped" in status.stdout + status.stderr, status.stdout + status.stderr
    resubmitted = _ray("job", "submit", "--address", address, "--working-dir", ".", "--",
                       *TRAIN, "--dp", "4", *common, cwd=REPO, env=env, timeout=480)
    output = resubmitted.stdout + resubmitted.stderr
    assert resubmitted.returncode == 0, output
    assert f"resuming from" in output and f"(step {stopped_at}," in output, output
    assert "resumed state verified" in output, output
    [check] = _resume_checks(store, "resub")
    assert check["equal"] and check["step"] == stopped_at and check["layout"].startswith("dp=4,")
    from rayshard.cluster.cli.main import build_parser
    from rayshard.cluster.cli.commands.train import config_from_args

    # The same flags on the same embedded config, uninterrupted, on a third layout.
    reference_args = build_parser().parse_args([*TRAIN[3:], "--dp", "2", "--store", str(tmp_path / "ref"), "--run", "ref"])
    uninterrupted = run_training(config_from_args(reference_args))
    losses = _losses(store, "resub")
    assert sorted(losses) == list(range(1, STEPS + 1))
    for step, loss in losses.items():
        assert abs(loss - uninterrupted.losses[step]) <= 1e-5 * abs(uninterrupted.losses[step]), (step, loss)


@pytest.mark.slow
def test_a_new_driver_continues_after_the_old_one_is_killed(ray_head, tmp_path):
    _, env, gcs_address = ray_head
    store = tmp_path / "store"
    steps = STEPS
    command = [sys.executable, "-m", "rayshard", *TRAIN[3:], "--dp", "2", "--store", str(store), "--run", "phoenix"]
    driver_env = dict(env, RAY_ADDRESS=gcs_address)  # a driver joining the cluster, as on a head node
    first = subprocess.Popen(command, cwd=REPO, env=driver_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        _wait_for_checkpoint(store, "phoenix", 2)
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    killed_at = _latest(store, "phoenix")
    assert killed_at < steps, "the first driver finished before it could be killed"
    second = subprocess.run(command, cwd=REPO, env=driver_env, capture_output=True, text=True, timeout=480)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"resuming from" in second.stdout and f"(step {killed_at}," in second.stdout, second.stdout[-3000:]
    assert _latest(store, "phoenix") == steps
    assert "resumed state verified" in second.stdout, second.stdout[-3000:]
    [check] = _resume_checks(store, "phoenix")
    assert check["equal"] and check["step"] == killed_at
    assert sorted(_losses(store, "phoenix")) == list(range(1, steps + 1))
