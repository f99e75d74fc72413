"""One hash of a step's global batch, the same on every layout: compares resumed runs step by step.

Each data rank hashes its own rows (one short digest per sample, in row order); the global hash is
the digest of all rows in global order, so it does not depend on how rows were split over ranks.
"""
from __future__ import annotations

import hashlib


def global_batch_hash(row_hashes_by_data_rank: list[str]) -> str:
    """row_hashes_by_data_rank: each data rank's comma-separated row digests, in data-rank order."""
    rows = ",".join(part for part in row_hashes_by_data_rank if part)
    return hashlib.blake2b(rows.encode(), digest_size=16).hexdigest() if rows else ""
