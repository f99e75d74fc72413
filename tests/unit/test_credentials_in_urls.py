"""A store URL written with credentials is refused before any request, and no secret reaches
stderr, with RAYSHARD_DEBUG=1's traceback too (s3fs would take key:secret@bucket as a bucket name
and botocore would print it)."""
import pytest

from rayshard.cluster.cli.main import main
from rayshard.plans.redaction import Redactor

SECRET = "hunter2zz"


@pytest.mark.parametrize("debug", ["", "1"])
def test_a_store_url_with_credentials_is_refused_without_printing_them(capsys, monkeypatch, debug):
    monkeypatch.setenv("RAYSHARD_DEBUG", debug)
    assert main(["ckpt", "ls", "--store", f"s3://AKIAXKEY:{SECRET}@bucket/runs"]) == 2
    err = capsys.readouterr().err
    assert SECRET not in err and "AKIAXKEY" not in err
    assert "rayshard: error: --store='s3://***@bucket/runs': a store URL cannot carry credentials" in err


@pytest.mark.parametrize("text, shown", [
    ('Invalid bucket name "KEY:se/cr+et@bkt"', 'Invalid bucket name "***@bkt"'),
    ("http://user:pw@host:9/x", "http://***@host:9/x"),
    ("s3://***@bucket", "s3://***@bucket"),
    ("model.py:12 in forward, at 10:30", "model.py:12 in forward, at 10:30"),
])
def test_userinfo_is_hidden_with_or_without_its_scheme(text, shown):
    assert Redactor().redact(text) == shown
