"""Credentials never reach the CLI's output or its errors: with distinctive AWS keys in the
environment, S3 operations that fail (a bucket that does not exist, a server answering 500 to
everything, shard reads failing mid-verify) leave neither key in stdout, stderr, or the text of
the exception and its causes — in process, and from a real `rayshard` process (which names the
failure in one `rayshard: error:` line, or shows the traceback with RAYSHARD_DEBUG=1). Secrets
hold '/', '+' and '=' as real ones do (about half of AWS secret keys hold a '/'), in the
environment, in a store URL's userinfo and in a query string (issue 43, finding 5)."""
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
# Secrets shaped like real ones: '/', '+' and '=' anywhere, a '/' before any '+' (s3fs cuts a
# URL's "bucket" at the first '/', which once left the key id and the secret's head in a message).
# Each holds all three; one runs by default, the others under -m slow (each case is a few processes).
SECRETS = ["wJalrXUtn/FEMI+K7MDENG=bPxRfiCY/EXAMPLE", *(pytest.param(secret, marks=pytest.mark.slow, id=secret)
                                                      for secret in ("Zx+9q/Lm2=Vb8/Rt+Yu0==", "a1b2c3d4e5=/f6g7+h8i9j0/k=="))]
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
    # The bucket is the answer, not "run 'r' has no committed checkpoint" (decision 227).
    text = _run(["ckpt", "verify", "r", "--store", missing], capsys)[0]
    assert "its bucket 'rayshard-missing-" in text and "does not exist" in text, text


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


def _pieces(secret: str) -> list[str]:
    """The secret and the parts of it a message could show (each side of a '/')."""
    return [secret] + [piece for piece in secret.split("/") if len(piece) >= 6]


def _rayshard(argv: list[str], env: dict, debug: bool) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayshard", *argv], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(env, PYTHONPATH=str(REPO), RAYSHARD_DEBUG="1" if debug else "0",
                                                RAYSHARD_S3_MAX_ATTEMPTS="1"))


@pytest.mark.parametrize("secret", SECRETS)
def test_credentials_in_a_store_url_are_refused_without_showing_them(s3_store, secret):
    """`key:secret@bucket` in --store is one line, exit 2, saying to use the environment; with
    RAYSHARD_DEBUG=1 the traceback shows neither the key id nor any piece of the secret."""
    bucket = s3_store.removeprefix("s3://").split("/", 1)[0]
    for debug in (False, True):
        done = _rayshard(["ckpt", "ls", "--store", f"s3://{KEY_ID}:{secret}@{bucket}/runs"], dict(os.environ), debug)
        shown = done.stdout + done.stderr
        assert done.returncode == 2, shown
        assert f"rayshard: error: --store='s3://***@{bucket}/runs': a store URL cannot carry credentials" in done.stderr
        assert "AWS_ACCESS_KEY_ID" in done.stderr and (debug or done.stderr.count("\n") == 1), done.stderr
        assert KEY_ID not in shown and not [piece for piece in _pieces(secret) if piece in shown], shown


@pytest.mark.parametrize("secret", SECRETS)
def test_secrets_on_the_command_line_never_show(s3_store, secret):
    """Where a URL with credentials reaches s3fs unrefused (`plan schedule --costs-from`), and
    where a signature rides in a query string, the output still shows no piece of them."""
    bucket = s3_store.removeprefix("s3://").split("/", 1)[0]
    env = dict(os.environ)
    for argv in (["plan", "schedule", "--costs-from", f"s3://{KEY_ID}:{secret}@{bucket}/runs/r"],
                 ["ckpt", "ls", "--store", f"s3://{bucket}/runs?X-Amz-Credential={KEY_ID}&X-Amz-Signature={secret}"],
                 ["ckpt", "verify", f"s3://{bucket}/runs/r/checkpoints/step-00000001?sv=2022-11-02&sig={secret}"]):
        for debug in (False, True):
            done = _rayshard(argv, env, debug)
            shown = done.stdout + done.stderr
            assert done.returncode in (2, 3) and "rayshard: error: " in done.stderr, shown
            assert KEY_ID not in shown and not [piece for piece in _pieces(secret) if piece in shown], (argv, shown)


@pytest.mark.parametrize("secret", SECRETS)
def test_environment_secrets_with_slashes_never_show(s3_store, fault_proxy, secret):
    """Keys from the environment sign every request; with every request failing, and with the
    traceback on, neither shows (nor a piece of the secret)."""
    fault_proxy.add("error500")
    env = dict(os.environ, AWS_ACCESS_KEY_ID=KEY_ID, AWS_SECRET_ACCESS_KEY=secret, AWS_SESSION_TOKEN=f"{secret}/session")
    done = _rayshard(["ckpt", "verify", "r@1", "--deep", "--store", s3_store], env, debug=True)
    shown = done.stdout + done.stderr
    assert done.returncode == 3 and "Traceback" in done.stderr, shown
    assert KEY_ID not in shown and not [piece for piece in _pieces(secret) if piece in shown], shown
