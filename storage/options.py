"""How every rayshard process talks to object storage: endpoint, retries, timeouts, upload sizes.

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

import os
from dataclasses import asdict, dataclass, fields

import fsspec

from rayshard.plans.errors import ConfigError

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
    # The longest one storage call of a catalog command (ls, show, verify, gc...) may take, its
    # retries and pages included: a listing, a HEAD, a batch of manifests, a batched delete.
    call_timeout_s: float = 600.0

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
        if not 0 < self.call_timeout_s < float("inf"):
            raise ConfigError("storage.call_timeout_s", self.call_timeout_s, "must be positive and finite",
                              "set RAYSHARD_S3_CALL_TIMEOUT_S to e.g. 600")
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


# The options this process applied (None: none yet, so the defaults). The client settings go to
# s3fs through fsspec's per-protocol config, the one way to reach every url_to_fs call; the upload
# sizes are rayshard's own and are read here.
_applied: StorageOptions | None = None


def configure(options: StorageOptions | None = None) -> dict:
    """Apply options (default: from the environment) to this process; return the conf to ship."""
    options = options or StorageOptions.from_env()
    conf = options.fsspec_conf()
    apply_conf(conf)
    return conf


def apply_conf(conf: dict) -> None:
    """What a rank actor (or a data task) runs with the driver's conf (see RankActor.configure_storage)."""
    global _applied
    fsspec.config.conf.update({protocol: settings for protocol, settings in conf.items() if protocol != "rayshard"})
    if "rayshard" in conf:
        _applied = StorageOptions(**conf["rayshard"])


def upload_options() -> StorageOptions:
    """The upload sizes and stall bound in force in this process: the driver's, once shipped."""
    return _applied or StorageOptions()
