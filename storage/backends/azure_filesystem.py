"""adlfs's AzureBlobFileSystem as rayshard opens every az:// and abfs:// URL (`azure.py` registers
it with fsspec by name, so this module and the 0.3 s of adlfs and the storage SDK load only on
the first such URL).

Three differences from adlfs's own: the SDK's retry policy is bounded from the same
`StorageOptions` as S3's (`max_attempts` tries with exponential backoff on 500/503, timeouts and
connection resets; connect and read timeouts per request), listings are never cached (the catalog
must see what other processes committed, as on S3), and the Azure CLI's AZURE_STORAGE_KEY is read
as the account key beside adlfs's AZURE_STORAGE_ACCOUNT_KEY.
"""
from __future__ import annotations

import logging
import os

from adlfs import AzureBlobFileSystem
from azure.storage.blob.aio import ExponentialRetry  # the async client needs the async policy

from rayshard.storage.options import upload_options

# The first retry waits about this long, each later one INCREMENT_BASE ** n seconds more (with up
# to a second of jitter): with the default 8 attempts, about two minutes of waiting in all.
INITIAL_BACKOFF_S = 0.5
INCREMENT_BASE = 2
# One request per read and per single-PUT object, up to this size: the loader already cuts its
# ranged reads to its memory budget, and the writer's single PUT is at most its upload budget
# ((max_concurrency + 1) parts, 80 MiB by default). The SDK's own defaults would split a 64 MiB
# read into a 32 MiB GET and eight 4 MiB GETs one after another, and a 65 MiB PUT into 4 MiB blocks.
SINGLE_REQUEST_BYTES = 256 * 2**20

_sdk_log = logging.getLogger("azure")
if _sdk_log.level == logging.NOTSET:
    # The SDK logs each retried request and undecodable error body as a warning; rayshard reports
    # a failure once, in its own words (a user's own logging configuration still decides).
    _sdk_log.setLevel(logging.ERROR)


class _OptionsInForce:
    """The storage options this process applies, read when fsspec looks up a cached instance: a
    process whose options change (the driver's, shipped to an actor) gets a client built with the
    new ones rather than one cached with the old."""

    def __get__(self, instance, owner):
        return upload_options()


class BoundedRetryBlobFileSystem(AzureBlobFileSystem):
    storage_options_in_force = _OptionsInForce()
    _extra_tokenize_attributes = (*AzureBlobFileSystem._extra_tokenize_attributes, "storage_options_in_force")

    def __init__(self, *args, account_key: str | None = None, **kwargs):
        kwargs.setdefault("use_listings_cache", False)
        super().__init__(*args, account_key=account_key or os.environ.get("AZURE_STORAGE_KEY"), **kwargs)

    def do_connect(self):
        super().do_connect()  # adlfs picks the credential: connection string, key, SAS, identity
        resolved = self.service_client
        options = upload_options()
        policy = ExponentialRetry(initial_backoff=INITIAL_BACKOFF_S, increment_base=INCREMENT_BASE,
                                  retry_total=options.max_attempts - 1, random_jitter_range=1)
        self.service_client = type(resolved)(resolved.url, credential=resolved.credential, retry_policy=policy,
                                             connection_timeout=options.connect_timeout_s,
                                             read_timeout=options.read_timeout_s,
                                             max_single_get_size=SINGLE_REQUEST_BYTES,
                                             max_single_put_size=SINGLE_REQUEST_BYTES)
