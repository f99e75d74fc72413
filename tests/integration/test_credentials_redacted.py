"""Credentials never reach the CLI's output or its errors: with distinctive AWS keys in the
environment, S3 operations that fail (a bucket that does not exist, a server answering 500 to
everything, shard reads failing mid-verify) leave neither key in stdout, stderr, or the text of
the exception and its causes — in process, and from a real `rayshard` process (which names the
failure in one `rayshard: error:` line, or shows the traceback with RAYSHARD_DEBUG=1)."""
from __future__ import annotations

import os
import subprocess
import sys
import traceback
import uuid
from pathlib import Path

import pytest

from rayshard.cluster.cli.main import main
from rayshard.plans.training.model_spec import preset
from tests.unit.checkpoint_factory import write_checkpoint

KEY_ID = "AKIARAYSHARDLEAKTEST7"
SECRET = "rayshard+Leak/Test-Secret-0123456789abcdefXYZ"
REPO = Path(__file__).resolve().parents[2]


def _use_distinctive_credentials(monkeypatch) -> None:
    import botocore.session
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("RAYSHARD_S3_MAX_ATTEMPTS", "1")  # fail on the first error, no backoff
    s3fs.S3FileSystem.clear_instance_cache()  # a cached client would still sign with the session's test keys
    credentials = botocore.session.get_session().get_credentials()
    assert (credentials.access_key, credentials.secret_key) == (KEY_ID, SECRET)  # these are the keys S3 calls sign with


def _run(argv: list[str], capsys) -> tuple[str, bool]:
    """(everything the command showed, whether it failed)."""
    try:
        failed, shown = main(argv) != 0, ""
    except Exception as error:  # the text a user sees: message, causes, traceback
        failed, shown = True, "".join(traceback.format_exception(error)) + repr(error)
    captured = capsys.readouterr()
    return captured.out + captured.err + shown, failed


def _assert_redacted(text: str) -> None:
    assert KEY_ID not in text and SECRET not in text, text


@pytest.fixture
def cleanup_clients():
    yield
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # the next test signs with the session's keys again


def test_a_missing_bucket(s3_store, monkeypatch, capsys, cleanup_clients):
    _use_distinctive_credentials(monkeypatch)
    missing = f"s3://rayshard-missing-{uuid.uuid4().hex[:12]}/store"
    for argv in (["ckpt", "ls", "--store", missing],
                 ["ckpt", "verify", "r", "--deep", "--store", missing],
                 ["ckpt", "verify", f"{missing}/r/checkpoints/step-00000001", "--deep"],
                 ["ckpt", "digest", f"{missing}/r/checkpoints/step-00000001"]):
        text, _ = _run(argv, capsys)
        _assert_redacted(text)
    assert "has no committed checkpoint" in _run(["ckpt", "verify", "r", "--store", missing], capsys)[0]


@pytest.mark.parametrize("faults", ["every-request", "shard-reads"])
def test_failing_requests(faults, s3_store, fault_proxy, monkeypatch, capsys, cleanup_clients):
    write_checkpoint(s3_store, "r", preset("tiny"), steps=1)
    _use_distinctive_credentials(monkeypatch)
    if faults == "every-request":
        fault_proxy.add("error500")
    else:
        fault_proxy.add("error500", method="GET", path=r"\.safetensors")
    for argv in (["ckpt", "ls", "--store", s3_store], ["ckpt", "verify", "r@1", "--deep", "--store", s3_store],
                 ["ckpt", "digest", "r@1", "--store", s3_store]):
        text, failed = _run(argv, capsys)
        assert failed or argv[1] == "ls", (argv, text)  # ls reads only listings and manifests
        _assert_redacted(text)
    assert any(rule.injected for rule in fault_proxy.rules)


def test_a_rayshard_process_shows_no_credentials(s3_store, fault_proxy):
    write_checkpoint(s3_store, "r", preset("tiny"), steps=1)
    fault_proxy.add("error500")
    env = dict(os.environ, AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=SECRET, RAYSHARD_S3_MAX_ATTEMPTS="1",
               PYTHONPATH=str(REPO))
    # One process each way (a process costs a torch import): `verify` without RAYSHARD_DEBUG is
    # checked in this process by test_failing_requests, through the same `main`.
    done = subprocess.run([sys.executable, "-m", "rayshard", "ckpt", "ls", "--store", s3_store], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    # It fails with one line naming the storage failure, not a traceback.
    assert done.returncode == 3 and "rayshard: error: storage request failed" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    _assert_redacted(done.stdout + done.stderr)
    debug = subprocess.run([sys.executable, "-m", "rayshard", "ckpt", "verify", "r@1", "--deep", "--store", s3_store],
                           cwd=REPO, env=dict(env, RAYSHARD_DEBUG="1"), capture_output=True, text=True, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr  # the traceback, on request
    _assert_redacted(debug.stdout + debug.stderr)
