"""test_credentials_redacted.py's promises on Azure Blob Storage (Azurite through its fault proxy):
with a distinctive account key or shared access signature in AZURE_STORAGE_CONNECTION_STRING, CLI
commands whose requests fail (a container that does not exist, a server answering 500 to
everything, shard reads failing mid-verify, a key the server does not know) show neither secret,
in process and from a real `rayshard` process, which names the failure in one line (exit 3)."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from rayshard.plans.training.model_spec import preset
from tests.azure_fixtures import ACCOUNT, PROXY_PORT, connection_string
from tests.integration.test_credentials_redacted import REPO, _run
from tests.unit.checkpoint_factory import write_checkpoint

ACCOUNT_KEY = "cmF5c2hhcmQtbGVhay10ZXN0LWF6dXJlLWFjY291bnQta2V5LTAxMjM0NTY3ODk="
SIGNATURE = "rayshardLeakTestSig0123456789abcdefXYZ"
SAS = f"sv=2024-08-04&ss=b&srt=sco&sp=rwdlac&se=2099-01-01T00:00:00Z&sig={SIGNATURE}%3D"
CREDENTIALS = {"key": connection_string(PROXY_PORT, ACCOUNT_KEY),
               "sas": f"BlobEndpoint=http://127.0.0.1:{PROXY_PORT}/{ACCOUNT};SharedAccessSignature={SAS}"}


def _use(monkeypatch, credential: str) -> None:
    from rayshard.storage.backends.azure_filesystem import BoundedRetryBlobFileSystem

    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", CREDENTIALS[credential])
    monkeypatch.setenv("RAYSHARD_S3_MAX_ATTEMPTS", "1")  # fail on the first error, no backoff
    BoundedRetryBlobFileSystem.clear_instance_cache()  # a cached client would sign with the session's key


def _assert_redacted(text: str) -> None:
    assert ACCOUNT_KEY not in text and SIGNATURE not in text, text


@pytest.fixture
def cleanup_clients():
    yield
    from rayshard.storage.backends.azure_filesystem import BoundedRetryBlobFileSystem

    BoundedRetryBlobFileSystem.clear_instance_cache()


@pytest.mark.parametrize("credential", ["key", "sas"])
def test_failing_requests(credential, az_store, azure_fault_proxy, monkeypatch, capsys, cleanup_clients):
    write_checkpoint(az_store, "r", preset("tiny"), steps=1)
    missing = f"az://rayshard-missing-{uuid.uuid4().hex[:12]}/store"
    _use(monkeypatch, credential)  # a key or signature Azurite does not know: every request is refused
    for argv in (["ckpt", "ls", "--store", az_store], ["ckpt", "verify", "r@1", "--deep", "--store", az_store],
                 ["ckpt", "ls", "--store", missing], ["ckpt", "digest", f"{missing}/r/checkpoints/step-00000001"]):
        text, failed = _run(argv, capsys)
        assert failed, (argv, text)
        _assert_redacted(text)
    azure_fault_proxy.add("error500", method="GET", path=r"\.safetensors")
    text, failed = _run(["ckpt", "verify", "r@1", "--deep", "--store", az_store], capsys)
    assert failed
    _assert_redacted(text)


def test_a_rayshard_process_names_the_failure_in_one_line(az_store, azure_fault_proxy):
    write_checkpoint(az_store, "r", preset("tiny"), steps=1)
    azure_fault_proxy.add("error500")
    env = dict(os.environ, AZURE_STORAGE_CONNECTION_STRING=CREDENTIALS["sas"], RAYSHARD_S3_MAX_ATTEMPTS="1",
               PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "rayshard", "ckpt", "ls", "--store", az_store], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and "rayshard: error: storage request failed" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr
    _assert_redacted(done.stdout + done.stderr)
    debug = subprocess.run([sys.executable, "-m", "rayshard", "ckpt", "verify", "r@1", "--deep", "--store", az_store],
                           cwd=REPO, env=dict(env, RAYSHARD_DEBUG="1"), capture_output=True, text=True, timeout=120)
    assert debug.returncode != 0 and "Traceback" in debug.stderr
    _assert_redacted(debug.stdout + debug.stderr)
