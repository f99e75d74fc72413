"""A preference dataset's precomputed reference log-probabilities (`rayshard data reference-logprobs`).

    URL/reference-logprobs.parquet   one row per example (document order): the reference's summed
                                     response log-probability; metadata: the dataset's index hash
                                     (the examples' content: tokens and masks) and the reference
                                     {url, digest} they were computed with

Pure: bytes in, records out. A run with `--dpo-precomputed` refuses, in one line, a file whose
index hash or reference digest is not its own (decision 162).
"""
from __future__ import annotations

import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayshard.plans.errors import RayshardError

REFERENCE_LOGPROBS = "reference-logprobs.parquet"
_KEY = b"rayshard.reference_logprobs"


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
