"""Fixed-length samples packed across documents, and the byte ranges that hold them.

The dataset is one token stream (documents in index order, each ending in the end-of-document
token) cut into shards. Sample i is the window of seq_len + 1 tokens starting at token i * seq_len
(inputs and targets overlap by one token), so a sample may span documents and shards.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TokenRead:
    """Tokens [start, stop) of one shard, counted within the shard."""

    shard: int
    start: int
    stop: int


def sample_count(total_tokens: int, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens at stride seq_len that fit in the stream."""
    return max(0, (total_tokens - 1) // seq_len)


def sample_reads(sample: int, seq_len: int, shard_starts: np.ndarray) -> list[TokenRead]:
    """The shard token ranges that hold sample `sample`, in stream order.

    shard_starts: the stream offset of each shard's first token, plus the stream's length last."""
    start, stop = sample * seq_len, sample * seq_len + seq_len + 1
    if stop > shard_starts[-1]:
        raise ValueError(f"sample {sample} ends at token {stop}, past the stream's {int(shard_starts[-1])}")
    first = int(np.searchsorted(shard_starts, start, side="right")) - 1
    reads = []
    shard = first
    while start < stop:
        end = min(stop, int(shard_starts[shard + 1]))
        if end > start:
            reads.append(TokenRead(shard, start - int(shard_starts[shard]), end - int(shard_starts[shard])))
        start, shard = end, shard + 1
    return reads
