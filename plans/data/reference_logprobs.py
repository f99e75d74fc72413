"""A preference dataset's precomputed reference log-probabilities (`rayshard data reference-logprobs`).

    URL/reference-logprobs/<digest>.parquet   one file per reference (its weights digest's first 16
                                              hex digits): one row per example (document order), the
                                              reference's summed response log-probability; metadata:
                                              the dataset's index hash (the examples' content: tokens
                                              and masks) and the reference {url, digest} it holds
    URL/reference-logprobs.parquet            the one file of datasets prepared before decision 201,
                                              still read when its reference is the run's

Pure: bytes in, records out. The driver picks the run's reference's file and the ranks read that
one; a run with `--dpo-precomputed` refuses, in one line, a dataset with no file of its reference,
naming those it has (decisions 162, 201).
"""
from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayshard.plans.errors import RayshardError

REFERENCE_LOGPROBS_DIR = "reference-logprobs"
LEGACY_REFERENCE_LOGPROBS = "reference-logprobs.parquet"  # before decision 201: one file per dataset
_KEY = b"rayshard.reference_logprobs"
_SHORT = 16  # hex digits of the digest in a file's name: 64 bits, no two references of one dataset collide


def reference_logprobs_file(digest: str) -> str:
    """The file (relative to the dataset) of the reference whose weights digest is `digest`
    ("sha256:<hex>")."""
    return f"{REFERENCE_LOGPROBS_DIR}/{digest.partition(':')[2][:_SHORT] or digest[:_SHORT]}.parquet"


def encode_reference_logprobs(logps: np.ndarray, index_hash: str, reference: dict) -> bytes:
    table = pa.table({"logp": pa.array(np.asarray(logps, dtype=np.float64))})
    table = table.replace_schema_metadata({_KEY: json.dumps({"index_hash": index_hash, "reference": reference}).encode()})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def decode_reference_logprobs(data: bytes, where: str) -> tuple[np.ndarray, dict]:
    """(logps, {"index_hash", "reference": {"url", "digest"}})."""
    try:
        table = pq.read_table(io.BytesIO(data))
        meta = json.loads(table.schema.metadata[_KEY])
    except (pa.ArrowException, OSError, KeyError, TypeError, ValueError):
        raise RayshardError(f"{where}: not a reference log-probabilities file. Fix: run `rayshard data "
                            "reference-logprobs` again") from None
    return table.column("logp").to_numpy(), meta
