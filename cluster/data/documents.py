"""The documents of an input file: a text file is one document, a JSONL line's field one, a
Parquet row's column one. Bad input raises DataInputError naming the file and row.
"""
from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayshard.actors.training.data import stdlib_files
from rayshard.plans.data.errors import DataInputError
from rayshard.storage.backends.registry import backend_for

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")
STDLIB = "stdlib"  # an input that names the standard library's .py files, as `train --data stdlib` does


@dataclass(frozen=True)
class Document:
    source: str
    row: int  # line (text: the file's first line; JSONL: its line) or row (Parquet), from 1
    text: str


@dataclass(frozen=True)
class ReadOptions:
    field: str = "text"   # the JSONL field that holds each document's text
    column: str = "text"  # the Parquet column that holds it
    skip_bad: bool = False
    max_bytes: int | None = None  # only the first input files, in order, up to this many bytes (--max-bytes)
    format: str = "text"  # "text": documents packed for next-token loss; "sft": prompt/completion examples with loss
    # masks; "preference": prompt/chosen/rejected pairs, stored as two adjacent examples with loss masks
    prompt_field: str = "prompt"          # --format sft: a JSONL field or Parquet column
    completion_field: str = "completion"
    messages_field: str = "messages"      # or a conversation the tokenizer's chat template renders
    max_tokens: int | None = None         # --format sft/preference: an example longer than this is a bad row (--max-tokens)
    chosen_field: str = "chosen"          # --format preference: the preferred response
    rejected_field: str = "rejected"      # and the dispreferred one


def input_files(urls: list[str], max_bytes: int | None = None) -> list[tuple[str, int]]:
    """(URL, size in bytes) of every file the inputs name (a file, a directory, a glob; any fsspec
    URL; `stdlib`: this Python's standard library sources, the byte-level trainer's default corpus),
    sorted within each input: the order documents take in a prepared dataset. max_bytes keeps the
    first files whose sizes add up to it (at least one)."""
    found = []
    for url in urls:
        if url == STDLIB:
            found += [(path, os.path.getsize(path)) for path in stdlib_files()]
            continue
        fs, path = fsspec.core.url_to_fs(url)
        backend = backend_for(fs)
        if any(c in path for c in "*?["):
            entries = fs.glob(path, detail=True)
        elif fs.isdir(path):
            entries = fs.find(path, detail=True)
        elif fs.exists(path):
            entries = {path: fs.info(path)}
        else:
            entries = {}
        files = sorted((p, int(info.get("size") or 0)) for p, info in entries.items() if info.get("type") != "directory")
        if not files:
            raise DataInputError(url, None, "no such file, directory or glob match", "pass existing files or URLs")
        found += [(backend.url(p), size) for p, size in files]
    if max_bytes is not None:
        sizes = np.cumsum([size for _, size in found])
        found = found[:max(1, int(np.searchsorted(sizes, max_bytes, side="right")))]
    return found


def read_input_file(url: str) -> bytes:
    """An input file's bytes, whole (one GET on an object store); an empty one is a bad input."""
    with fsspec.open(url, "rb") as handle:
        data = handle.read()
    if not data:
        raise DataInputError(url, None, "the file is empty", "remove it from the inputs, or pass --skip-bad")
    return data


def read_documents(url: str, options: ReadOptions, skipped: list[str]) -> Iterator[Document]:
    """The file's documents; under options.skip_bad, a bad row (or file) is left out and described
    in `skipped` instead of raising."""
    try:
        data = read_input_file(url)
        lower = url.lower()
        if lower.endswith(PARQUET_SUFFIXES):
            yield from _parquet_documents(url, data, options, skipped)
        elif lower.endswith(JSONL_SUFFIXES):
            yield from _jsonl_documents(url, data, options, skipped)
        else:
            yield Document(url, 1, _utf8(url, data))
    except DataInputError as error:
        if not options.skip_bad:
            raise
        skipped.append(str(error))


def _utf8(url: str, data: bytes, first_row: int = 1) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        row = first_row + data[:error.start].count(b"\n")
        raise DataInputError(url, row, f"not UTF-8 text (byte {error.start}: {data[error.start:error.start + 1]!r})",
                             "convert the file to UTF-8, or pass --skip-bad to leave it out") from None


def _jsonl_documents(url: str, data: bytes, options: ReadOptions, skipped: list[str]) -> Iterator[Document]:
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(_utf8(url, line, number))
            if not isinstance(record, dict) or options.field not in record:
                raise DataInputError(url, number, f"no field {options.field!r}",
                                     "pass --field NAME naming the text field, or --skip-bad to leave such rows out")
            text = record[options.field]
            if not isinstance(text, str):
                raise DataInputError(url, number, f"field {options.field!r} holds {type(text).__name__}, not text",
                                     "pass --field NAME naming a text field, or --skip-bad")
        except json.JSONDecodeError as error:
            bad = DataInputError(url, number, f"not JSON ({error.msg})", "fix the line, or pass --skip-bad")
            if not options.skip_bad:
                raise bad from None
            skipped.append(str(bad))
            continue
        except DataInputError as error:
            if not options.skip_bad:
                raise
            skipped.append(str(error))
            continue
        yield Document(url, number, text)


def _parquet_documents(url: str, data: bytes, options: ReadOptions, skipped: list[str]) -> Iterator[Document]:
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError) as error:
        raise DataInputError(url, None, f"not a readable Parquet file ({_first_line(error)})",
                             "write it again, or pass --skip-bad to leave it out") from None
    if options.column not in table.column_names:
        raise DataInputError(url, None, f"no column {options.column!r} (columns: {table.column_names})",
                             "pass --column NAME naming the text column")
    for number, text in enumerate(table.column(options.column).to_pylist(), start=1):
        if not isinstance(text, str):
            bad = DataInputError(url, number, f"column {options.column!r} holds {type(text).__name__}, not text",
                                 "pass --column NAME naming a text column, or --skip-bad")
            if not options.skip_bad:
                raise bad
            skipped.append(str(bad))
            continue
        yield Document(url, number, text)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
