"""Azure Blob Storage for tests: Azurite (Microsoft's storage emulator, from the npm registry) on
127.0.0.1 behind the same fault-injecting proxy as S3, and a fresh container per test.

Azurite is installed once into build/azurite (ignored by git) with `npm install` of the pinned
version below (`make azurite` does the same), started once per session on a free port with its
blobs in memory, and stopped by its own pid. Without node and npm the Azure tests skip, saying so.

The account is Azurite's own development account, whose key is public. Azure clients find the
endpoint in the connection string beside the key (there is no separate endpoint variable as on
AWS), so the whole string is set when this plugin is imported, before any test starts Ray, with
ports chosen now: the rank actors inherit it with the Ray session's environment, as they would a
cluster's real credentials. A developer's own AZURE_STORAGE_* variables never reach a test.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.free_port import free_port

AZURITE_VERSION = "3.37.0"
REPO = Path(__file__).resolve().parents[1]
AZURITE_DIR = REPO / "build" / "azurite"
AZURITE_BIN = AZURITE_DIR / "node_modules" / ".bin" / "azurite-blob"
ACCOUNT = "devstoreaccount1"
# Azurite's well-known development key (documented by Microsoft; it opens nothing but an emulator).
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_PORT, PROXY_PORT = free_port(), free_port()


def connection_string(port: int, key: str = ACCOUNT_KEY) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};")


for _name in [name for name in os.environ if name.startswith("AZURE_STORAGE_")]:
    os.environ.pop(_name)
os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(PROXY_PORT)  # clients go through the proxy


def install_azurite() -> str | None:
    """Path of the azurite-blob launcher, installing the pinned version once; None (with the reason
    in `install_azurite.reason`) when node or npm is missing or the install fails."""
    if AZURITE_BIN.exists() and (AZURITE_DIR / f".version-{AZURITE_VERSION}").exists():
        return str(AZURITE_BIN)
    if not (shutil.which("node") and shutil.which("npm")):
        install_azurite.reason = "node and npm are not installed: the Azure tests need Azurite from the npm registry"
        return None
    AZURITE_DIR.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["npm", "install", "--prefix", str(AZURITE_DIR), "--no-audit", "--no-fund",
                             "--loglevel=error", f"azurite@{AZURITE_VERSION}"],
                            capture_output=True, text=True, timeout=600)
    if result.returncode != 0 or not AZURITE_BIN.exists():
        install_azurite.reason = f"npm install azurite@{AZURITE_VERSION} failed: {result.stderr.strip()[-500:]}"
        return None
    (AZURITE_DIR / f".version-{AZURITE_VERSION}").touch()
    return str(AZURITE_BIN)


def _wait_listening(port: int, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"Azurite exited with {process.returncode} before listening on {port}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"Azurite did not listen on 127.0.0.1:{port} within {timeout_s:g}s")


@contextlib.contextmanager
def running_azurite(launcher: str, log_path: Path):
    """Azurite on 127.0.0.1:AZURITE_PORT until the block ends, its output in log_path; yields the
    account's blob endpoint. Also used by tests/e2e/elastic_scenario.py, outside pytest."""
    log = open(log_path, "wb")
    # In memory, no telemetry; --skipApiVersionCheck: the Azure SDK may be newer than the emulator.
    process = subprocess.Popen([launcher, "--blobHost", "127.0.0.1", "--blobPort", str(AZURITE_PORT),
                                "--inMemoryPersistence", "--skipApiVersionCheck", "--disableTelemetry", "--silent"],
                               stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_listening(AZURITE_PORT, process)
        yield f"http://127.0.0.1:{AZURITE_PORT}/{ACCOUNT}"
    finally:
        process.terminate()  # its own pid, nothing else
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=15)
        log.close()


@pytest.fixture(scope="session")
def azurite_server(tmp_path_factory):
    launcher = install_azurite()
    if launcher is None:
        pytest.skip(install_azurite.reason)
    with running_azurite(launcher, tmp_path_factory.mktemp("azurite") / "azurite.log") as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def azure_fault_proxy_server(azurite_server):
    from tests.fault_proxy import FaultProxy

    proxy = FaultProxy("127.0.0.1", AZURITE_PORT, listen_port=PROXY_PORT).start()
    yield proxy
    proxy.stop()


@pytest.fixture
def azure_fault_proxy(azure_fault_proxy_server):
    """The session's Azure proxy with no rules; rules added by a test end with it."""
    azure_fault_proxy_server.clear()
    yield azure_fault_proxy_server
    azure_fault_proxy_server.clear()


@pytest.fixture
def az_store(azure_fault_proxy, monkeypatch):
    """az://<fresh container>/store on Azurite, through the fault proxy. Returns the store URL."""
    from azure.storage.blob import BlobServiceClient

    from rayshard.storage import options as storage_options
    from rayshard.storage.backends.azure_filesystem import BoundedRetryBlobFileSystem
    from tests.s3_fixtures import TEST_STORAGE_ENV

    for name, value in TEST_STORAGE_ENV.items():
        monkeypatch.setenv(name, value)
    storage_options.configure()
    BoundedRetryBlobFileSystem.clear_instance_cache()  # clients built now take these retries and timeouts
    container = f"test-{uuid.uuid4().hex[:16]}"
    with BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"]) as service:
        service.create_container(container)
    yield f"az://{container}/store"
    monkeypatch.undo()
    storage_options.configure()
    BoundedRetryBlobFileSystem.clear_instance_cache()


@dataclass(frozen=True)
class ObjectStore:
    kind: str  # "s3" or "az"
    url: str
    proxy: object  # the FaultProxy in front of its server


@pytest.fixture(params=["s3", "az"])
def object_store(request) -> ObjectStore:
    """A fresh store on each object store rayshard has a backend for: S3 (moto) and Azure Blob
    Storage (Azurite), each behind its fault proxy. Tests written once run on both."""
    if request.param == "s3":
        return ObjectStore("s3", request.getfixturevalue("s3_store"), request.getfixturevalue("fault_proxy"))
    return ObjectStore("az", request.getfixturevalue("az_store"), request.getfixturevalue("azure_fault_proxy"))
