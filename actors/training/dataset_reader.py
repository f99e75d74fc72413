"""A rank's view of a prepared dataset: the index once, then only its own samples' byte ranges.

Sample ids come from `plans/data/sample_order.py` (a pure function of seed, step and the sample
count), so every layout reads the same samples for a step; the reads are ranged (`cat_ranges`,
concurrent on S3), one or two per sample, and nothing else of the shards is fetched. Every
document a read holds whole is checked against the index's CRC32 (actors/training/document_checks.py).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import fsspec
import numpy as np
import torch

from rayshard.actors.training.document_checks import DocumentChecks
from rayshard.plans.data.dataset_index import INDEX, PREFERENCE, SFT, DatasetIdentity, decode_index
from rayshard.plans.data.reference_logprobs import decode_reference_logprobs
from rayshard.plans.data.packing import sample_count, sample_reads
from rayshard.plans.data.sample_order import batch_sample_ids
from rayshard.plans.errors import ConfigError, RayshardError


def holds_prepared_dataset(url: str) -> bool:
    """Whether url is the --out of `rayshard data prepare` (its index exists)."""
    if url == "stdlib" or any(c in url for c in "*?["):
        return False
    fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
    return fs.exists(f"{root}/{INDEX}")


@dataclass(frozen=True)
class ExampleRows:
    """A data rank's rows of one global batch of an SFT or preference dataset. windows: [rows,
    seq_len + 1] int64, each an example padded with the end-of-document token; masks: bool, same
    shape, 0 on prompt and padding; global_count: the mean's denominator over the whole global
    batch (SFT: its completion targets; DPO: its pairs); tokens: the input positions of these rows
    that hold an example's own tokens, padding left out (each example's length, at most seq_len:
    what tokens/s counts, decision 203); reference_logps: --dpo-precomputed, the rows' reference
    log-probabilities."""

    windows: torch.Tensor
    masks: torch.Tensor
    global_count: int
    tokens: int
    reference_logps: torch.Tensor | None = None


class PreparedDataset:
    """Packed windows of the token stream (objective lm, any dataset), or, with sft=True, one
    example per sample (an SFT dataset's, padded to seq_len + 1, with its loss mask), or, with
    preference=True, one preference pair per sample (its chosen and rejected examples, so)."""

    def __init__(self, url: str, seq_len: int, sft: bool = False, preference: bool = False):
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
        self.sft, self.preference = sft, preference
        if sft or preference:
            self._open_examples(documents, url)
        self.samples = (self.meta.documents // 2 if preference else self.meta.documents if sft
                        else sample_count(self.meta.tokens, seq_len))
        if self.samples < 1:
            raise ConfigError("seq_len", seq_len, f"dataset {url} holds {self.meta.tokens} tokens, fewer than one sample "
                              f"of {seq_len + 1}", "prepare more text or lower --seq-len")
        self.shard_paths = [f"{self.root}/{shard}" for shard in self.meta.shards]
        self.shard_starts = self.meta.shard_starts
        self.dtype = np.dtype(self.meta.dtype).newbyteorder("<")

    def _open_examples(self, documents, url: str) -> None:
        wanted, objective = (PREFERENCE, "dpo") if self.preference else (SFT, "sft")
        if self.meta.kind != wanted:
            held = {SFT: "SFT examples", PREFERENCE: "preference pairs"}.get(self.meta.kind, "text")
            raise ConfigError("objective", objective, f"dataset {url} holds {held}, not "
                              f"{'preference pairs' if self.preference else 'SFT examples'}",
                              f"prepare one with `rayshard data prepare --format {wanted}`, or train with another --objective")
        if self.meta.longest > self.seq_len + 1:
            longest = int(np.argmax(documents.column("tokens").to_numpy()))
            where = f"{documents.column('source')[longest].as_py()}, row {documents.column('row')[longest].as_py()}"
            raise ConfigError("seq_len", self.seq_len, f"dataset {url} holds an example of {self.meta.longest} tokens "
                              f"({where}); a sample holds seq_len + 1 = {self.seq_len + 1}",
                              f"pass --seq-len {self.meta.longest - 1} or more, or prepare again with "
                              f"--max-tokens {self.seq_len + 1} --skip-bad")
        column = lambda name: documents.column(name).to_numpy().astype(np.int64)  # noqa: E731
        self.example_shard, self.example_start = column("shard"), column("token_start")
        self.example_tokens, self.example_loss_tokens = column("tokens"), column("loss_tokens")
        self.mask_crc32 = column("mask_crc32")
        self.mask_paths = [f"{self.root}/{mask}" for mask in self.meta.masks]

    def identity(self) -> DatasetIdentity:
        return DatasetIdentity(self.url, self.meta.index_hash, self.meta.tokenizer_hash,
                               f"{self.url}/{self.meta.tokenizer}")

    def rank_windows(self, seed: int, step: int, batch: int, data_rank: int, data_ranks: int) -> torch.Tensor:
        """This data rank's contiguous rows of global batch `step`: [rows, seq_len + 1] int64."""
        per_rank = batch // data_ranks
        ids = batch_sample_ids(seed, step, batch, self.samples)[data_rank * per_rank:(data_rank + 1) * per_rank]
        return torch.from_numpy(self.read_samples(ids))

    def rank_examples(self, seed: int, step: int, batch: int, data_rank: int, data_ranks: int) -> ExampleRows:
        """This data rank's rows of global batch `step` of an SFT dataset, and the completion
        targets of the whole global batch, from the index: every rank knows the mean's denominator
        without a collective."""
        per_rank = batch // data_ranks
        ids = batch_sample_ids(seed, step, batch, self.samples)
        global_loss_tokens = int(self.example_loss_tokens[ids].sum())
        own = ids[data_rank * per_rank:(data_rank + 1) * per_rank]
        windows, masks = self.read_examples(own)
        return ExampleRows(torch.from_numpy(windows), torch.from_numpy(masks), global_loss_tokens, self._tokens(own))

    def _tokens(self, examples: np.ndarray) -> int:
        """The input positions of these examples' rows holding their own tokens (an example fills
        seq_len + 1 at most, of which the model reads seq_len)."""
        return int(np.minimum(self.example_tokens[examples], self.seq_len).sum())

    def read_reference_logprobs(self, name: str | None) -> None:
        """--dpo-precomputed: the reference's log-probability of every example, from the dataset's
        file `name` (relative to it), the one the driver picked for the run's reference after
        checking its digest; the examples' index hash is checked here too (decisions 162, 201)."""
        if not name:
            raise RayshardError("--dpo-precomputed: no reference log-probabilities file was chosen for this run's "
                                "ranks. Fix: start the run with `rayshard train`, whose driver picks the reference's file")
        where = f"{self.url}/{name}"
        with self.fs.open(f"{self.root}/{name}", "rb") as f:
            logps, meta = decode_reference_logprobs(f.read(), where)
        if meta.get("index_hash") != self.meta.index_hash or len(logps) != self.meta.documents:
            raise RayshardError(f"{where} was computed for index hash {meta.get('index_hash')}, not this dataset's "
                                f"{self.meta.index_hash}. Fix: run `rayshard data reference-logprobs` again")
        self.reference_logps = logps

    def rank_pairs(self, seed: int, step: int, batch: int, data_rank: int, data_ranks: int) -> ExampleRows:
        """This data rank's rows of global batch `step` of a preference dataset: `batch` counts
        sequences, so the step holds batch / 2 pairs, drawn as sample ids (a pure function of seed
        and step); each pair's chosen then rejected example, adjacent, so an even cut of the rows
        (data ranks, microbatches) never splits a pair. The global count is the step's pairs; after
        read_reference_logprobs the rows carry their reference log-probabilities."""
        pairs, per_rank = batch // 2, batch // 2 // data_ranks
        ids = batch_sample_ids(seed, step, pairs, self.samples)[data_rank * per_rank:(data_rank + 1) * per_rank]
        examples = np.stack([2 * ids, 2 * ids + 1], axis=1).reshape(-1)
        windows, masks = self.read_examples(examples)
        reference = getattr(self, "reference_logps", None)
        return ExampleRows(torch.from_numpy(windows), torch.from_numpy(masks), pairs, self._tokens(examples),
                           None if reference is None else torch.from_numpy(reference[examples].astype(np.float32)))

    def read_examples(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Whole examples by byte ranges (tokens and masks, each checked against the index's CRC32),
        padded to seq_len + 1."""
        itemsize = self.dtype.itemsize
        shards, starts, counts = self.example_shard[ids], self.example_start[ids], self.example_tokens[ids]
        paths = [self.shard_paths[s] for s in shards] + [self.mask_paths[s] for s in shards]
        begin = np.concatenate([starts * itemsize, starts])
        end = np.concatenate([(starts + counts) * itemsize, starts + counts])
        blobs = self.fs.cat_ranges(paths, begin.tolist(), end.tolist(), on_error="return")
        for path, start, stop, blob in zip(paths, begin, end, blobs):
            if isinstance(blob, BaseException) or len(blob) != stop - start:
                problem = f"{type(blob).__name__}: {blob}" if isinstance(blob, BaseException) else f"{len(blob)} bytes returned"
                raise RayshardError(f"{path}: reading bytes [{start}, {stop}) failed ({problem}); the dataset is "
                                    "incomplete or was changed. Fix: prepare it again, or check the store")
        windows = np.full((len(ids), self.seq_len + 1), self.meta.eos_id, dtype=np.int64)
        masks = np.zeros((len(ids), self.seq_len + 1), dtype=bool)
        for row, (shard, start, count) in enumerate(zip(shards, starts, counts)):
            tokens, mask = np.frombuffer(blobs[row], dtype=self.dtype), blobs[len(ids) + row]
            self.checks.verify(int(shard), int(start), tokens, self.shard_paths[shard])  # the example is read whole
            if zlib.crc32(mask) != int(self.mask_crc32[ids[row]]):
                raise RayshardError(f"{self.mask_paths[shard]}: the loss mask at tokens [{start}, {start + count}) does "
                                    "not match the index's CRC32; the mask file was damaged after it was prepared. "
                                    "Fix: prepare the dataset again")
            windows[row, :count] = tokens
            masks[row, :count] = np.frombuffer(mask, dtype=np.uint8).astype(bool)
        return windows, masks

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
