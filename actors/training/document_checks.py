"""CRC32 checks of what a rank reads from a prepared dataset's shards.

The index holds one CRC32 per document. A rank reads sample windows (seq_len + 1 tokens), not
documents, so it checks every document that a read holds whole: it has all of that document's
bytes anyway, and a CRC32 of a few KiB costs microseconds. A document that is longer than a window,
or that straddles two windows, is never read whole and so is not checked here (reading it whole
would multiply the bytes a step fetches); `rayshard data prepare` wrote its checksum from the bytes
it wrote, and the index hash covers the checksums.
"""
from __future__ import annotations

import zlib

import numpy as np
import pyarrow as pa

from rayshard.plans.errors import RayshardError


class DocumentChecks:
    def __init__(self, documents: pa.Table, shards: int):
        shard = documents.column("shard").to_numpy()
        starts = documents.column("token_start").to_numpy()
        ends = starts + documents.column("tokens").to_numpy()
        self.crc32 = documents.column("crc32").to_numpy()
        self.documents = documents
        # Per shard: its documents' rows in the index, their token starts and ends (ascending).
        order = np.argsort(shard, kind="stable")  # already sorted in stream order; stable keeps token order
        bounds = np.searchsorted(shard[order], np.arange(shards + 1))
        self.rows = [order[bounds[s]:bounds[s + 1]] for s in range(shards)]
        self.starts = [starts[rows] for rows in self.rows]
        self.ends = [ends[rows] for rows in self.rows]
        self.checked = 0  # documents verified so far (tests read it)

    def verify(self, shard: int, start: int, tokens: np.ndarray, path: str) -> None:
        """tokens: the shard's tokens [start, start + len(tokens)) as read; raises naming the file and
        the document when a document they hold whole does not match its CRC32."""
        stop = start + len(tokens)
        first = int(np.searchsorted(self.starts[shard], start, side="left"))
        last = int(np.searchsorted(self.ends[shard], stop, side="right"))
        data = tokens.view(np.uint8)
        itemsize = tokens.dtype.itemsize
        for at in range(first, last):
            begin, end = int(self.starts[shard][at]), int(self.ends[shard][at])
            found = zlib.crc32(data[(begin - start) * itemsize:(end - start) * itemsize])
            row = int(self.rows[shard][at])
            if found != int(self.crc32[row]):
                source = self.documents.column("source")[row].as_py()
                line = self.documents.column("row")[row].as_py()
                raise RayshardError(
                    f"{path}: the document from {source}, row {line} (bytes [{begin * itemsize}, {end * itemsize})) has CRC32 "
                    f"{found:08x}, the index says {int(self.crc32[row]):08x}; the shard was damaged after it was prepared. "
                    "Fix: prepare the dataset again (or restore the shard from a copy)")
            self.checked += 1
