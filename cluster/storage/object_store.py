"""How every rayshard process talks to object storage: options, and conditional writes.

Options are resolved once on the driver (from the standard AWS variables plus RAYSHARD_S3_*)
and shipped to each rank actor as plain fsspec configuration, because actors are separate
processes started by Ray and do not see variables the driver set after Ray started. The options
never hold credentials: each process finds its own through the standard AWS chain (variables,
profiles, instance or pod roles), so no secret travels through Ray or lands in a log.

Retries come from botocore's "standard" mode: throttling (503 SlowDown), 5xx and connection
resets are retried with jittered exponential backoff; every request has connect and read
timeouts, so a stalled connection turns into a retry instead of a hang.
"""
from __future__ import annotations

import fcntl
import os
import threading
import uuid
from dataclasses import asdict, dataclass, fields

import fsspec
from fsspec.asyn import sync
from fsspec.implementations.local import LocalFileSystem

from plans.errors import ConfigError

MiB = 2**20


@dataclass(frozen=True)
class StorageOptions:
    endpoint_url: str | None = None  # S3-compatible servers (MinIO, moto); None: AWS
    region: str | None = None
    max_attempts: int = 8  # per request, first try included
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0  # per request: a silent server is retried, not waited on forever
    part_size_mib: int = 16  # multipart part size; one upload buffers at most (max_concurrency + 1) parts
    max_concurrency: int = 4  # parts in flight per rank: memory bound = part_size * max_concurrency
    # A part (or a small object's single PUT) not done this long after it was sent fails the
    # save, naming the rank and the object: the bound on a stalled upload, retries included.
    stall_timeout_s: float = 300.0

    @classmethod
    def from_env(cls, environ=os.environ) -> "StorageOptions":
        """AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL and AWS_REGION as the AWS tools read them;
        RAYSHARD_S3_<FIELD> (e.g. RAYSHARD_S3_PART_SIZE_MIB=16) for the rest."""
        values = {"endpoint_url": environ.get("AWS_ENDPOINT_URL_S3") or environ.get("AWS_ENDPOINT_URL"),
                  "region": environ.get("AWS_REGION") or environ.get("AWS_DEFAULT_REGION")}
        for field in fields(cls):
            raw = environ.get(f"RAYSHARD_S3_{field.name.upper()}")
            if raw is None:
                continue
            kind = float if field.type in ("float", float) else int if field.type in ("int", int) else str
            try:
                values[field.name] = kind(raw)
            except ValueError:
                raise ConfigError(f"RAYSHARD_S3_{field.name.upper()}", raw, f"must be a {kind.__name__}",
                                  "fix or unset the environment variable") from None
        return cls(**values).validate()

    def validate(self) -> "StorageOptions":
        if self.stall_timeout_s <= 0:
            raise ConfigError("storage.stall_timeout_s", self.stall_timeout_s, "must be positive",
                              "set RAYSHARD_S3_STALL_TIMEOUT_S to e.g. 300")
        for name in ("max_attempts", "part_size_mib", "max_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"storage.{name}", getattr(self, name), "must be at least 1",
                                  f"set RAYSHARD_S3_{name.upper()} to 1 or more")
        if self.part_size_mib < 5:
            raise ConfigError("storage.part_size_mib", self.part_size_mib, "S3 multipart parts must be at least 5 MiB",
                              "set RAYSHARD_S3_PART_SIZE_MIB to 5 or more")
        return self

    @property
    def part_size(self) -> int:
        return self.part_size_mib * MiB

    def fsspec_conf(self) -> dict:
        """fsspec's per-protocol defaults (fsspec.config.conf): picked up by every url_to_fs call
        in the process, including the ones inside the rank actors' checkpoint code."""
        s3 = {
            "config_kwargs": {"retries": {"mode": "standard", "max_attempts": self.max_attempts},
                              "connect_timeout": self.connect_timeout_s, "read_timeout": self.read_timeout_s},
            "max_concurrency": self.max_concurrency,
        }
        if self.endpoint_url:
            s3["endpoint_url"] = self.endpoint_url
        if self.region:
            s3["client_kwargs"] = {"region_name": self.region}
        # Listings are never cached: the catalog must see what other processes committed.
        s3["use_listings_cache"] = False
        return {"s3": s3, "rayshard": asdict(self)}


def configure(options: StorageOptions | None = None) -> dict:
    """Apply options (default: from the environment) to this process; return the conf to ship."""
    options = options or StorageOptions.from_env()
    conf = options.fsspec_conf()
    apply_conf(conf)
    return conf


def apply_conf(conf: dict) -> None:
    """What a rank actor runs with the driver's conf (see RankActor.configure_storage)."""
    fsspec.config.conf.update(conf)


def is_s3(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocol


# ---- conditional writes ------------------------------------------------------------------------
#
# The commit protocol needs two primitives: create an object only if it does not exist, and
# replace an object only if it still is the version we read (compare-and-swap). S3 has both as
# conditional PUTs (If-None-Match: * and If-Match: <ETag>); a local filesystem gets them from
# link() and a lock file. Other fsspec filesystems fall back to check-then-write under a
# process-local lock: enough for memory:// in tests, not for writers in several processes.

class PreconditionFailed(Exception):
    """The object changed (or appeared) since it was read: another writer got there first."""


_fallback_lock = threading.Lock()


def create_only(fs, path: str, data: bytes) -> None:
    """Write path only if it does not exist; raise FileExistsError otherwise."""
    if isinstance(fs, LocalFileSystem):
        temporary = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temporary, path)  # fails if the name exists, atomically
        finally:
            os.unlink(temporary)
        return
    if is_s3(fs):
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            # A retried PUT whose first try landed (the reply was lost) also fails its
            # condition: the object is then ours, byte for byte.
            if fs.cat_file(path) != data:
                raise
        return
    with _fallback_lock:
        if fs.exists(path):
            raise FileExistsError(path)
        fs.pipe_file(path, data)


def read_versioned(fs, path: str) -> tuple[bytes | None, str | None]:
    """(content, version token) of path, or (None, None) if it does not exist. The token is what
    replace_if checks: the ETag on S3, the content itself elsewhere."""
    if is_s3(fs):
        try:
            return sync(fs.loop, _s3_get_with_etag, fs, path)
        except FileNotFoundError:
            return None, None
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None, None
    return data, data.hex()


def replace_if(fs, path: str, data: bytes, token: str | None) -> None:
    """Write path only if it still holds the version `token` (None: only if it does not exist).
    Raises PreconditionFailed when another writer changed it in between."""
    if is_s3(fs):
        try:
            if token is None:
                fs.pipe_file(path, data, mode="create")
            else:
                fs.pipe_file(path, data, IfMatch=token)
        except (FileExistsError, OSError) as error:
            if isinstance(error, FileNotFoundError) or _precondition_failed(error):
                if read_versioned(fs, path)[0] == data:
                    return  # our own write landed on an earlier try of a retried request
                raise PreconditionFailed(path) from None
            raise
        return
    if isinstance(fs, LocalFileSystem):
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # serialises writers on this machine
            _swap_under_lock(fs, path, data, token)
        return
    with _fallback_lock:
        _swap_under_lock(fs, path, data, token)


def _swap_under_lock(fs, path: str, data: bytes, token: str | None) -> None:
    current = read_versioned(fs, path)[1]
    if current != token:
        raise PreconditionFailed(path)
    if isinstance(fs, LocalFileSystem):
        temporary = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(temporary, "wb") as handle:
            handle.write(data)
        os.replace(temporary, path)
    else:
        fs.pipe_file(path, data)


def _precondition_failed(error: BaseException) -> bool:
    cause = error.__cause__ or error.__context__
    text = f"{error} {cause}"
    return isinstance(error, FileExistsError) or "PreconditionFailed" in text or "412" in text


async def _s3_get_with_etag(fs, path: str) -> tuple[bytes, str]:
    bucket, key, _ = fs.split_path(path)
    response = await fs._call_s3("get_object", Bucket=bucket, Key=key)
    try:
        data = await response["Body"].read()
    finally:
        response["Body"].close()
    return data, response["ETag"]


# ---- multipart uploads -----------------------------------------------------------------------


@dataclass(frozen=True)
class PendingUpload:
    path: str  # bucket/key
    upload_id: str
    initiated_unix: float


def pending_uploads(fs, root: str) -> list[PendingUpload]:
    """Multipart uploads started under root and never completed or aborted (S3 only): their
    parts cost storage but no listing shows them."""
    if not is_s3(fs):
        return []
    bucket, prefix, _ = fs.split_path(root)
    found, markers = [], {}
    while True:
        page = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix.rstrip('/')}/" if prefix else "", **markers)
        for upload in page.get("Uploads", []) or []:
            found.append(PendingUpload(f"{bucket}/{upload['Key']}", upload["UploadId"], upload["Initiated"].timestamp()))
        if not page.get("IsTruncated"):
            return found
        markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}


def abort_upload(fs, upload: PendingUpload) -> None:
    bucket, key, _ = fs.split_path(upload.path)
    fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload.upload_id)
