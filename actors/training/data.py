"""Byte-level token data whose global sample order depends only on (seed, step).

Every rank can compute any step's global batch and takes its own rows, so the order of samples
is the same on every layout and resuming needs only the step (the data position) and the seed.
The default corpus is this Python's standard library sources: present offline on any machine.
"""
from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
import zlib

import fsspec
import torch

from rayshard.storage.backends.registry import backend_for


def stdlib_files() -> list[str]:
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "__pycache__"))
        found.extend(os.path.join(directory, f) for f in sorted(files) if f.endswith(".py"))
    return found


def _source_files(source: str) -> list[str]:
    if source == "stdlib":
        return stdlib_files()
    if "://" in source:
        fs, path = fsspec.core.url_to_fs(source)
        paths = fs.glob(path) if fs.isfile(path) is False and any(c in path for c in "*?[") else [path]
        if len(paths) == 1 and fs.isdir(paths[0]):
            paths = sorted(p for p in fs.find(paths[0]))
        backend = backend_for(fs)
        return [backend.url(p) for p in sorted(paths)]
    if os.path.isdir(source):
        return sorted(os.path.join(d, f) for d, _, fs in os.walk(source) for f in fs)
    matches = sorted(glob.glob(source))
    if not matches:
        raise FileNotFoundError(f"data.source={source!r}: no such file, directory or glob match. "
                                "Fix: pass an existing path or URL, or 'stdlib' for the built-in corpus")
    return matches


def load_corpus(source: str, max_bytes: int) -> torch.Tensor:
    """The first max_bytes bytes of the source files, in sorted order, as uint8 tokens."""
    chunks, total = [], 0
    for path in _source_files(source):
        with fsspec.open(path, "rb") as handle:
            data = handle.read(max_bytes - total)
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clone()


def corpus_fingerprint(corpus: torch.Tensor) -> str:
    """Size and checksum, saved with checkpoints so a resume notices a different corpus."""
    return f"{corpus.numel()}:{zlib.crc32(corpus.numpy().tobytes()):08x}"


def _step_seed(seed: int, step: int) -> int:
    digest = hashlib.blake2b(f"data:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def global_batch(corpus: torch.Tensor, seed: int, step: int, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each [batch, seq_len] int64, for one step of the whole job."""
    if corpus.numel() < seq_len + 2:
        raise ValueError(f"corpus has {corpus.numel()} tokens; a sample needs {seq_len + 1}")
    generator = torch.Generator().manual_seed(_step_seed(seed, step))
    starts = torch.randint(0, corpus.numel() - seq_len - 1, (batch,), generator=generator)
    windows = corpus[starts[:, None] + torch.arange(seq_len + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def rank_batch(corpus, seed, step, batch, seq_len, data_rank, data_ranks):
    """This data rank's contiguous slice of the global batch."""
    inputs, targets = global_batch(corpus, seed, step, batch, seq_len)
    per_rank = batch // data_ranks
    rows = slice(data_rank * per_rank, (data_rank + 1) * per_rank)
    return inputs[rows], targets[rows]


def row_hashes(inputs: torch.Tensor, targets: torch.Tensor) -> str:
    """One short digest per sample (its seq_len + 1 token ids), comma-separated in row order: the
    driver joins every data rank's into the global batch's hash (plans/data/batch_hash.py)."""
    windows = torch.cat([inputs, targets[:, -1:]], dim=1).to(torch.int64).cpu().numpy()
    return ",".join(hashlib.blake2b(row.astype("<i8").tobytes(), digest_size=8).hexdigest() for row in windows)
