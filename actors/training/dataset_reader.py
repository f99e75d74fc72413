"""A rank's view of a prepared dataset: the index once, then only its own samples' byte ranges.

Sample ids come from `plans/data/sample_order.py` (a pure function of seed, step and the sample
count), so every layout reads the same samples for a step; the reads are ranged (`cat_ranges`,
concurrent on S3), one or two per sample, and nothing else of the shards is fetched. Every
document a read holds whole is checked against the index's CRC32 (actors/training/document_checks.py).
"""
from __future__ import annotations

import fsspec
import numpy as np
import torch

from rayshard.actors.training.document_checks import DocumentChecks
from rayshard.plans.data.dataset_index import INDEX, DatasetIdentity, decode_index
from rayshard.plans.data.packing import sample_count, sample_reads
from rayshard.plans.data.sample_order import batch_sample_ids
from rayshard.plans.errors import ConfigError, RayshardError


def holds_prepared_dataset(url: str) -> bool:
    """Whether url is the --out of `rayshard data prepare` (its index exists)."""
    if url == "stdlib" or any(c in url for c in "*?["):
        return False
    fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
    return fs.exists(f"{root}/{INDEX}")


class PreparedDataset:
    def __init__(self, url: str, seq_len: int):
        self.url = url.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.url)
        index_path = f"{self.root}/{INDEX}"
        try:
            data = self.fs.cat_file(index_path)
        except FileNotFoundError:
            raise ConfigError("data.dataset", url, f"holds no {INDEX} (no committed dataset)",
                              "pass the --out URL of a finished `rayshard data prepare`") from None
        self.meta, documents = decode_index(data, f"{self.url}/{INDEX}")
        self.checks = DocumentChecks(documents, len(self.meta.shards))
        self.seq_len = seq_len
        self.samples = sample_count(self.meta.tokens, seq_len)
        if self.samples < 1:
            raise ConfigError("seq_len", seq_len, f"dataset {url} holds {self.meta.tokens} tokens, fewer than one sample "
                              f"of {seq_len + 1}", "prepare more text or lower --seq-len")
        self.shard_paths = [f"{self.root}/{shard}" for shard in self.meta.shards]
        self.shard_starts = self.meta.shard_starts
        self.dtype = np.dtype(self.meta.dtype).newbyteorder("<")

    def identity(self) -> DatasetIdentity:
        return DatasetIdentity(self.url, self.meta.index_hash, self.meta.tokenizer_hash,
                               f"{self.url}/{self.meta.tokenizer}")

    def rank_windows(self, seed: int, step: int, batch: int, data_rank: int, data_ranks: int) -> torch.Tensor:
        """This data rank's contiguous rows of global batch `step`: [rows, seq_len + 1] int64."""
        per_rank = batch // data_ranks
        ids = batch_sample_ids(seed, step, batch, self.samples)[data_rank * per_rank:(data_rank + 1) * per_rank]
        return torch.from_numpy(self.read_samples(ids))

    def read_samples(self, ids: np.ndarray) -> np.ndarray:
        """Rows of seq_len + 1 token ids, one per sample id, read by byte ranges."""
        reads = [(row, read) for row, sample in enumerate(ids) for read in sample_reads(int(sample), self.seq_len, self.shard_starts)]
        itemsize = self.dtype.itemsize
        paths = [self.shard_paths[read.shard] for _, read in reads]
        starts = [read.start * itemsize for _, read in reads]
        ends = [read.stop * itemsize for _, read in reads]
        blobs = self.fs.cat_ranges(paths, starts, ends, on_error="return")
        rows: list[list[np.ndarray]] = [[] for _ in ids]
        for (row, read), path, start, end, blob in zip(reads, paths, starts, ends, blobs):
            if isinstance(blob, BaseException) or len(blob) != end - start:
                problem = (f"{type(blob).__name__}: {blob}" if isinstance(blob, BaseException)
                           else f"{len(blob)} bytes returned")
                raise RayshardError(f"{path}: reading bytes [{start}, {end}) failed ({problem}); the dataset is "
                                    "incomplete or was changed. Fix: prepare it again, or check the store")
            tokens = np.frombuffer(blob, dtype=self.dtype)
            self.checks.verify(read.shard, read.start, tokens, path)
            rows[row].append(tokens)
        return np.stack([np.concatenate(parts) for parts in rows]).astype(np.int64)
