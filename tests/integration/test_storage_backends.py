"""Every registered backend keeps the `Backend` protocol's promises, over its real protocol: local
files, S3 (moto through the fault proxy), Azure Blob Storage (Azurite through the fault proxy) and
an fsspec filesystem with no backend of its own (memory://). A new backend adds its scheme to
STORES and passes the same checks."""
from __future__ import annotations

import traceback
import uuid

import fsspec
import pytest

from rayshard.cluster.catalog.store import Store
from rayshard.plans.checkpoint.reshard import Request
from rayshard.storage import options as storage_options
from rayshard.storage.backends.azure import AzureBackend
from rayshard.storage.backends.fsspec_generic import FsspecBackend
from rayshard.storage.backends.local import LocalBackend
from rayshard.storage.backends.protocol import Backend, PreconditionFailed
from rayshard.storage.backends.registry import BACKEND_CLASSES, backend_class, backend_for, open_url
from rayshard.storage.backends.s3 import S3Backend
from rayshard.storage.options import StorageOptions, upload_options

STORES = {"local": LocalBackend, "s3": S3Backend, "az": AzureBackend, "memory": FsspecBackend}
OBJECT_STORES = ("s3", "az")  # multipart or staged uploads: an unfinished object stays invisible
MiB = 2**20


@pytest.fixture(params=sorted(STORES))
def opened(request, tmp_path):
    if request.param == "s3":
        url = request.getfixturevalue("s3_store")
    elif request.param == "az":
        url = request.getfixturevalue("az_store")
    elif request.param == "memory":
        url = f"memory://backends-{uuid.uuid4().hex[:8]}"
    else:
        url = str(tmp_path / "store")
        fsspec.filesystem("file").makedirs(url, exist_ok=True)
    backend, root = open_url(url)
    return request.param, backend, root


def test_the_registry_picks_each_schemes_own_backend(opened):
    kind, backend, _ = opened
    assert type(backend) is STORES[kind] and isinstance(backend, Backend)


def test_every_registered_backend_implements_the_whole_protocol():
    for scheme in BACKEND_CLASSES:
        assert isinstance(backend_class(scheme)(fsspec.filesystem("memory")), Backend), scheme


def test_create_only_refuses_an_existing_object_and_keeps_its_bytes(opened):
    _, backend, root = opened
    backend.create_only(f"{root}/manifest", b"first")
    with pytest.raises(FileExistsError):
        backend.create_only(f"{root}/manifest", b"second")
    assert backend.fs.cat_file(f"{root}/manifest") == b"first"


def test_replace_if_is_a_compare_and_swap(opened):
    _, backend, root = opened
    path = f"{root}/LATEST"
    assert backend.read_versioned(path) == (None, None)
    backend.replace_if(path, b"step-1", None)
    with pytest.raises(PreconditionFailed):
        backend.replace_if(path, b"step-x", None)  # None: only if absent, and it exists now
    data, token = backend.read_versioned(path)
    assert data == b"step-1"
    backend.replace_if(path, b"step-2", token)
    with pytest.raises(PreconditionFailed):
        backend.replace_if(path, b"step-3", token)  # the version read before the last swap
    assert backend.read_versioned(path)[0] == b"step-2"


def test_a_writer_streams_an_object_that_exists_only_once_closed(opened):
    _, backend, root = opened
    payload = bytes(range(256)) * 4099 + b"tail"  # asymmetric: a swapped or repeated block shows
    path = f"{root}/objects/blob"
    backend.make_directory(f"{root}/objects")
    with backend.open_writer(path) as handle:
        for start in range(0, len(payload), 100_003):
            handle.write(payload[start:start + 100_003])
    assert backend.fs.cat_file(path) == payload


def test_a_writer_that_fails_leaves_no_object_on_an_object_store(opened):
    kind, backend, root = opened
    if kind not in OBJECT_STORES:
        pytest.skip("local and memory files are visible while written; the commit protocol never names them")
    path = f"{root}/objects/broken"
    with pytest.raises(RuntimeError, match="producer died"):
        with backend.open_writer(path) as handle:
            handle.write(b"x" * 1000)
            raise RuntimeError("producer died")
    assert not backend.fs.exists(path)
    assert backend.pending_uploads(root) == []


def test_ranged_reads_return_exactly_the_bytes_asked_for(opened):
    _, backend, root = opened
    payload = bytes((i * 7 + i // 251) % 256 for i in range(70_000))
    backend.fs.pipe_file(f"{root}/shard", payload)
    ranges = [(0, 1), (5, 4096), (4096, 70_000), (69_999, 70_000), (123, 6000)]
    requests = [Request("shard", start, end, ()) for start, end in ranges]
    arrived = dict(backend.fetch_ranges(root, requests, budget_bytes=80_000))
    assert {(r.byte_start, r.byte_end): arrived[r] for r in requests} == {(s, e): payload[s:e] for s, e in ranges}


def test_replace_overwrites_whole(opened):
    _, backend, root = opened
    backend.replace(f"{root}/metrics", b"old" * 100)
    backend.replace(f"{root}/metrics", b"new")
    assert backend.fs.cat_file(f"{root}/metrics") == b"new"


def test_a_url_names_the_same_path_again(opened):
    kind, backend, root = opened
    url = backend.url(f"{root}/x")
    assert open_url(url)[1] == f"{root}/x"
    assert url == f"{root}/x" if kind == "local" else url.startswith(f"{kind}://")  # a local path as typed


def test_an_unregistered_scheme_goes_through_fsspec_under_its_own_name():
    backend = backend_for(fsspec.filesystem("memory"))
    assert type(backend) is FsspecBackend and backend.scheme == "memory"
    assert not backend.local_paths and backend.pending_uploads("/anything") == []


def test_upload_sizes_are_the_shipped_options_and_default_to_the_one_definition():
    before = upload_options()
    try:
        storage_options.apply_conf({"rayshard": {**StorageOptions().fsspec_conf()["rayshard"], "part_size_mib": 7}})
        assert upload_options().part_size == 7 * MiB
    finally:
        storage_options.apply_conf(before.fsspec_conf())
    assert StorageOptions().part_size_mib == 16 and upload_options() == before


def test_an_s3_writer_cuts_parts_of_the_shipped_size(s3_store):
    backend, root = open_url(s3_store)
    before = upload_options()
    try:
        storage_options.apply_conf({"rayshard": {**before.fsspec_conf()["rayshard"], "part_size_mib": 5,
                                                 "max_concurrency": 1}})
        with backend.open_writer(f"{root}/big") as writer:
            assert writer.part_size == 5 * MiB and writer.max_concurrency == 1
            writer.write(b"\x01" * (11 * MiB + 3))  # more than (concurrency + 1) parts: multipart
        assert backend.fs.size(f"{root}/big") == 11 * MiB + 3
    finally:
        storage_options.apply_conf(before.fsspec_conf())


def _abandoned_writer(backend, path: str, size: int):
    """A writer that streamed `size` bytes in 5 MiB parts and then died without closing or
    aborting: the parts it sent landed, nothing else happened."""
    before = upload_options()
    storage_options.apply_conf({"rayshard": {**before.fsspec_conf()["rayshard"], "part_size_mib": 5,
                                             "max_concurrency": 1}})
    try:
        writer = backend.open_writer(path).__enter__()  # never exited: the process "died" here
        writer.write(b"\x02" * size)
        while writer.in_flight:  # the parts already sent reach the server before the "crash"
            writer._finish_oldest()
    finally:
        storage_options.apply_conf(before.fsspec_conf())
    return writer


def test_a_writer_that_dies_leaves_a_pending_upload_that_abort_removes(opened):
    kind, backend, root = opened
    if kind not in OBJECT_STORES:
        pytest.skip("local and memory writes have no upload state beside the file")
    backend.fs.pipe_file(f"{root}/objects/committed", b"kept")
    _abandoned_writer(backend, f"{root}/objects/crashed", 11 * MiB)
    pending = backend.pending_uploads(root)
    assert [upload.path for upload in pending] == [f"{root}/objects/crashed"]
    assert not backend.fs.exists(f"{root}/objects/crashed")
    assert backend.pending_uploads(f"{root}/elsewhere") == []
    backend.abort_upload(pending[0])
    assert backend.pending_uploads(root) == []
    assert not backend.fs.exists(f"{root}/objects/crashed")  # the abort leaves no object behind either
    assert backend.fs.cat_file(f"{root}/objects/committed") == b"kept"


def test_an_aborted_upload_never_removes_an_object_committed_meanwhile(opened):
    kind, backend, root = opened
    if kind not in OBJECT_STORES:
        pytest.skip("local and memory writes have no upload state beside the file")
    _abandoned_writer(backend, f"{root}/objects/raced", 11 * MiB)
    [pending] = backend.pending_uploads(root)
    backend.fs.pipe_file(f"{root}/objects/raced", b"another writer finished first")
    backend.abort_upload(pending)
    assert backend.fs.cat_file(f"{root}/objects/raced") == b"another writer finished first"


KEY_ID = "AKIARAYSHARDLEAKTEST7"
SECRET = "rayshard+Leak/Test-Secret-0123456789abcdefXYZ"
AZURE_KEY = "cmF5c2hhcmQtbGVhay10ZXN0LWF6dXJlLWFjY291bnQta2V5LTAxMjM0NTY3ODk="  # base64, as account keys are
AZURE_SAS = "sv=2024-08-04&ss=b&srt=sco&sp=rwdlac&se=2099-01-01T00:00:00Z&sig=rayshardLeakTestSig0123456789abcdefXYZ%3D"


# Azure's two credentials: -m slow; tests/integration/test_azure_credentials_redacted.py fails
# requests signed with both in the default suite (decision 178).
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "az" else k for k in OBJECT_STORES])
@pytest.mark.parametrize("credential", ["key", "sas"])
def test_a_failing_request_names_no_credential(kind, credential, request, monkeypatch):
    """Requests signed with distinctive secrets fail (the server does not know them, or answers
    500 to everything): no secret appears in the error, its causes or its traceback."""
    if kind == "s3" and credential == "sas":
        pytest.skip("S3 has no shared access signatures")
    url = request.getfixturevalue(f"{kind}_store")
    proxy = request.getfixturevalue("fault_proxy" if kind == "s3" else "azure_fault_proxy")
    monkeypatch.setenv("RAYSHARD_S3_MAX_ATTEMPTS", "2")
    storage_options.configure()
    secrets = [KEY_ID, SECRET] if kind == "s3" else [AZURE_KEY, "rayshardLeakTestSig"]
    if kind == "s3":
        import s3fs

        monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        s3fs.S3FileSystem.clear_instance_cache()
        request.addfinalizer(s3fs.S3FileSystem.clear_instance_cache)
    else:
        from rayshard.storage.backends.azure_filesystem import BoundedRetryBlobFileSystem
        from tests.azure_fixtures import ACCOUNT, PROXY_PORT, connection_string

        endpoint = f"BlobEndpoint=http://127.0.0.1:{PROXY_PORT}/{ACCOUNT};"
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", connection_string(PROXY_PORT, AZURE_KEY) if credential == "key"
                           else f"{endpoint}SharedAccessSignature={AZURE_SAS}")
        filesystem = BoundedRetryBlobFileSystem
        filesystem.clear_instance_cache()
        request.addfinalizer(filesystem.clear_instance_cache)
    backend, root = open_url(url)
    shown = []
    for faults in ([], ["error500"]):
        for fault in faults:
            proxy.add(fault)
        for operation in (lambda: backend.read_versioned(f"{root}/LATEST"),
                          lambda: backend.create_only(f"{root}/manifest", b"m"),
                          lambda: backend.fs.ls(root),
                          lambda: backend.pending_uploads(root)):
            try:
                operation()
            except Exception as error:  # the text a user would see: message, causes, traceback
                shown.append("".join(traceback.format_exception(error)) + repr(error))
    assert shown  # the requests did fail
    for text in shown:
        assert not any(secret in text for secret in secrets), text


def test_a_versioned_read_whose_reply_breaks_off_is_read_again(s3_store, fault_proxy):
    """A GET whose body is cut short after the headers (botocore does not retry a broken body):
    the read of LATEST or of a run's log is made again, not failed (found by the storage soak)."""
    store = Store(s3_store)
    path = f"{store.root}/r/LATEST"
    store.backend.replace(path, b"step-00000042" * 100)
    rule = fault_proxy.add("cut_body", method="GET", path=r"/r/LATEST", times=2)
    data, version = store.backend.read_versioned(path)
    assert rule.injected == 2 and data == b"step-00000042" * 100 and version
