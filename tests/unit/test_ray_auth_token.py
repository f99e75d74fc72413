"""`ensure_auth_token`: a fresh machine under RAY_AUTH_MODE=token has no token, and a multi-node
`ray.cluster_utils.Cluster` (the recovery bench, the e2e scenarios) or `ray start` makes none, so
their GCS refused to start; the process makes one for its own clusters, and leaves any existing
token alone."""
from __future__ import annotations

import os
import stat

import pytest

from rayshard.cluster.ray_connection import ensure_auth_token


@pytest.fixture
def fresh_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    # set first: monkeypatch then restores the variable (or its absence) after the test, whatever
    # ensure_auth_token wrote into os.environ itself
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "")
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH")
    return tmp_path


def test_a_fresh_machine_gets_a_token_only_its_owner_reads(fresh_machine):
    ensure_auth_token()
    path = os.environ["RAY_AUTH_TOKEN_PATH"]
    token = open(path).read()
    assert len(token) == 64 and int(token, 16) >= 0
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


@pytest.mark.parametrize("existing", ["home file", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"])
def test_an_existing_token_is_left_alone(fresh_machine, monkeypatch, existing):
    if existing == "home file":
        (fresh_machine / ".ray").mkdir()
        (fresh_machine / ".ray" / "auth_token").write_text("a" * 64)
    else:
        monkeypatch.setenv(existing, "given")
    ensure_auth_token()
    assert os.environ.get("RAY_AUTH_TOKEN_PATH") == ("given" if existing == "RAY_AUTH_TOKEN_PATH" else None)


def test_without_token_mode_nothing_is_made(fresh_machine, monkeypatch):
    monkeypatch.delenv("RAY_AUTH_MODE")
    ensure_auth_token()
    assert "RAY_AUTH_TOKEN_PATH" not in os.environ
