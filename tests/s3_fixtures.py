"""S3 for tests: moto's ThreadedMotoServer on 127.0.0.1 (once per session, as s3fs's own tests
do) behind a fault-injecting proxy, and a fresh bucket per test.

Credentials are fake and set when this plugin is imported — before any test starts Ray — so
the rank actors, which inherit the environment of the Ray session, find them through the
standard AWS chain exactly as they would find real ones. The endpoint is not set here: the
driver resolves it per test (AWS_ENDPOINT_URL) and ships it to the actors explicitly.
"""
from __future__ import annotations

import os
import threading
import uuid

import pytest

# Fake credentials only: a developer's real ones must never reach a test server.
os.environ.update({
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-do-not-log",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",  # never probe 169.254.169.254: only 127.0.0.1 exists here
})
os.environ.pop("AWS_SESSION_TOKEN", None)
os.environ.pop("AWS_PROFILE", None)

# Small timeouts and quick retries keep fault tests short; production defaults are larger.
TEST_STORAGE_ENV = {"RAYSHARD_S3_READ_TIMEOUT_S": "3", "RAYSHARD_S3_CONNECT_TIMEOUT_S": "2",
                    "RAYSHARD_S3_MAX_ATTEMPTS": "6", "RAYSHARD_S3_PART_SIZE_MIB": "5"}


def _serialise_conditional_writes() -> None:
    """Real S3 evaluates If-None-Match / If-Match atomically with the write; moto checks, then
    writes, so two racing requests could both pass. A lock around moto's conditional writes gives
    the race tests S3's semantics, so they test our protocol rather than moto's window."""
    from moto.s3.responses import S3Response

    lock = threading.Lock()

    def locked(method):
        def wrapper(self, *args, **kwargs):
            if "If-None-Match" in self.headers or "If-Match" in self.headers:
                with lock:
                    return method(self, *args, **kwargs)
            return method(self, *args, **kwargs)
        return wrapper

    if not getattr(S3Response, "_rayshard_locked", False):
        S3Response.put_object = locked(S3Response.put_object)
        S3Response._key_response_post = locked(S3Response._key_response_post)
        S3Response._rayshard_locked = True


@pytest.fixture(scope="session")
def moto_server():
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request drowns failures
    _serialise_conditional_writes()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def fault_proxy_server(moto_server):
    from tests.fault_proxy import FaultProxy

    host, port = moto_server.removeprefix("http://").split(":")
    proxy = FaultProxy(host, int(port)).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def fault_proxy(fault_proxy_server):
    """The session's proxy with no rules; rules added by a test end with it."""
    fault_proxy_server.clear()
    yield fault_proxy_server
    fault_proxy_server.clear()


@pytest.fixture
def s3_store(fault_proxy, monkeypatch):
    """s3://<fresh bucket>/store, reached through the fault proxy (no faults until a test adds
    rules). Returns the store URL."""
    import boto3

    for name, value in TEST_STORAGE_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.url)
    bucket = f"test-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=fault_proxy.url, region_name="us-east-1").create_bucket(Bucket=bucket)
    yield f"s3://{bucket}/store"
    monkeypatch.undo()
    # The next test may use another endpoint: the process-wide fsspec options follow the env.
    from rayshard.storage import options as storage_options

    storage_options.configure()
