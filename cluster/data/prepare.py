"""`rayshard data prepare`: input files tokenized with Ray Data into token shards plus a Parquet
index, committed the way checkpoints are.

    shards and the tokenizer go under URL/attempt-<id>/   (Ray Data map_batches, one call per unit of input files)
    URL/index.parquet is created last, create-only        (the commit: a dataset exists once it does)

A prepare that dies leaves only an attempt folder no index names; one that meets bad input removes
its attempt before reporting it.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import ray

from rayshard.cluster.data.documents import ReadOptions, input_files
from rayshard.cluster.data.examples import chat_template_of
from rayshard.cluster.data.prepare_pipeline import run_units
from rayshard.cluster.data.prepare_task import UnitResult
from rayshard.cluster.data.tokenizer import LoadedTokenizer, save_tokenizer
from rayshard.storage import options as storage_options
from rayshard.storage.backends.registry import backend_for
from rayshard.plans.data.dataset_index import (INDEX, INDEX_SCHEMA, MASKED_KINDS, PREFERENCE, SFT, SFT_INDEX_SCHEMA, TEXT,
                                               DatasetMeta, encode_index, table_hash, token_dtype_for)
from rayshard.plans.errors import RayshardError

UNIT_BYTES = 64 << 20  # input bytes per task at most: a shard per unit, a few per CPU on small inputs


@dataclass(frozen=True)
class PrepareSummary:
    url: str
    documents: int
    tokens: int
    input_bytes: int
    shard_bytes: int
    skipped: list[str]
    seconds: float
    index_hash: str

    def line(self) -> str:
        skipped = f", {len(self.skipped)} bad input(s) skipped" if self.skipped else ""
        return (f"prepared {self.url}: {self.documents:,} documents, {self.tokens:,} tokens, "
                f"{self.input_bytes / 2**20:.2f} MiB text -> {self.shard_bytes / 2**20:.2f} MiB shards in {self.seconds:.1f}s "
                f"({self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s){skipped}; index hash {self.index_hash}")


def plan_units(files: list[tuple[str, int]], workers: int, unit_bytes: int = UNIT_BYTES) -> list[list[str]]:
    """Consecutive files grouped so each unit holds at most unit_bytes (a file alone may hold more)
    and there are several units per worker when the input is small."""
    total = sum(size for _, size in files)
    target = max(1, min(unit_bytes, total // max(1, 4 * workers)))
    units, current, held = [], [], 0
    for url, size in files:
        if current and held + size > target:
            units.append(current)
            current, held = [], 0
        current.append(url)
        held += size
    return units + ([current] if current else [])


def prepare_dataset(inputs: list[str], tokenizer: LoadedTokenizer, out_url: str, options: ReadOptions = ReadOptions(),
                    cpus_per_task: float = 1.0, task_timeout_s: float = 600.0, progress=None,
                    log: Callable[[str], None] = print) -> PrepareSummary:
    """progress: a tqdm-like bar advanced by input bytes as units finish (cluster/progress.py)."""
    started = time.perf_counter()
    url = out_url.rstrip("/")
    fs, root = fsspec.core.url_to_fs(url)
    if fs.exists(f"{root}/{INDEX}"):
        raise RayshardError(f"{url} already holds a prepared dataset ({INDEX}). Fix: choose another --out, "
                            "or delete it first")
    files = input_files(inputs, options.max_bytes)
    workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
    units = plan_units(files, workers)
    if progress is not None:
        progress.reset(total=sum(size for _, size in files))
    attempt = f"attempt-{uuid.uuid4().hex[:12]}"
    dtype = token_dtype_for(tokenizer.vocab_size)
    log(f"preparing {len(files)} file(s) in {len(units)} unit(s) with Ray Data ({workers} CPUs), tokens as {dtype}")
    try:
        chat = chat_template_of(tokenizer.config_json, tokenizer.source)
        results = _run_units(units, files, tokenizer.json_text, tokenizer.eos_id, dtype, url, attempt, options,
                             cpus_per_task, min(workers, len(units)), task_timeout_s, progress, chat)
        bad = next((r.error for r in results if r.error is not None), None)
        if bad is not None:
            raise bad
        tokenizer_dir = f"{attempt}/tokenizer"
        save_tokenizer(tokenizer, f"{url}/{tokenizer_dir}")
        meta, documents = _index(results, tokenizer, dtype, tokenizer_dir, {"sft": SFT, "preference": PREFERENCE}.get(options.format, TEXT))
        if meta.documents == 0:
            raise RayshardError(f"no documents in {inputs} ({meta.skipped} bad input(s) skipped). "
                                "Fix: pass files that hold text")
        backend_for(fs).create_only(f"{root}/{INDEX}", encode_index(documents, meta))
    except BaseException:
        if fs.exists(f"{root}/{attempt}"):  # nothing names it; leave no orphan behind
            fs.rm(f"{root}/{attempt}", recursive=True)
        raise
    skipped = [line for r in results for line in r.skipped]
    return PrepareSummary(url, meta.documents, meta.tokens, sum(r.input_bytes for r in results),
                          meta.tokens * np.dtype(dtype).itemsize, skipped, time.perf_counter() - started, meta.index_hash)


def _run_units(units, files, tokenizer_json, eos_id, dtype, url, attempt, options, cpus_per_task, concurrency,
               task_timeout_s, progress, chat=None) -> list[UnitResult]:
    """Every unit's result in unit order, or only the first bad input's unit when not skipping."""
    sizes = dict(files)
    storage_conf = storage_options.configure()  # the tasks reach the store as the driver does
    results: dict[int, UnitResult] = {}
    stream = run_units(units, tokenizer_json, eos_id, dtype, url, attempt, options, storage_conf, cpus_per_task,
                       concurrency, task_timeout_s, chat)
    try:
        for result in stream:
            results[result.unit] = result
            if progress is not None:
                progress.update(sum(sizes[f] for f in units[result.unit]))
            if result.error is not None:
                return [result]
    finally:
        stream.close()  # stops the dataset's remaining units before the driver removes the attempt
    return [results[unit] for unit in range(len(units))]


def _index(results: list[UnitResult], tokenizer: LoadedTokenizer, dtype: str, tokenizer_dir: str,
           kind: str = TEXT) -> tuple[DatasetMeta, pa.Table]:
    itemsize = np.dtype(dtype).itemsize
    kept = [r for r in results if r.tokens]  # a unit whose every input was skipped writes an empty shard
    schema = SFT_INDEX_SCHEMA if kind in MASKED_KINDS else INDEX_SCHEMA
    columns: dict[str, list] = {name: [] for name in schema.names}
    for shard, result in enumerate(kept):
        counts = np.asarray(result.tokens, dtype=np.int64)
        token_starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        columns["source"] += result.sources
        columns["row"] += result.rows
        columns["shard"] += [shard] * len(counts)
        columns["token_start"] += token_starts.tolist()
        columns["tokens"] += counts.tolist()
        columns["byte_start"] += (token_starts * itemsize).tolist()
        columns["byte_end"] += ((token_starts + counts) * itemsize).tolist()
        columns["crc32"] += result.crc32
        if kind in MASKED_KINDS:
            columns["loss_tokens"] += result.loss_tokens
            columns["mask_crc32"] += result.mask_crc32
    documents = pa.Table.from_pydict(columns, schema=schema)
    shard_tokens = tuple(int(sum(r.tokens)) for r in kept)
    digest = table_hash(tokenizer.hash, dtype, kind, documents)
    meta = DatasetMeta(tokenizer_hash=tokenizer.hash, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eos_id, dtype=dtype,
                       shards=tuple(r.shard for r in kept), shard_tokens=shard_tokens, tokenizer=tokenizer_dir,
                       documents=documents.num_rows, tokens=int(sum(shard_tokens)),
                       skipped=sum(len(r.skipped) for r in results), index_hash=digest, kind=kind,
                       masks=tuple(r.mask for r in kept) if kind in MASKED_KINDS else (),
                       longest=max((r.longest for r in kept), default=0))
    return meta, documents
