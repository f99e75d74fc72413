"""A prepared dataset's index: one Parquet row per document, its metadata, and their codec.

    URL/index.parquet                          the commit: created last, create-only
    URL/attempt-<id>/shard-00000.tokens        little-endian uint16 or uint32 token ids, no header
    URL/attempt-<id>/tokenizer/tokenizer.json  the tokenizer that made them (and tokenizer_config.json)

Pure: bytes in, records out (like the checkpoint manifest codec). The index hash is computed from
the content (tokenizer, token dtype, per-document token counts and checksums, in order), not from the Parquet
bytes, so re-preparing the same text with the same tokenizer gives the same identity.
"""
from __future__ import annotations

import hashlib
import io
import json
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from rayshard.plans.errors import RayshardError

INDEX = "index.parquet"
FORMAT = "rayshard-dataset/1"
METADATA_KEY = b"rayshard_dataset"
INDEX_SCHEMA = pa.schema([
    ("source", pa.string()),     # the input file the document came from
    ("row", pa.int64()),         # its line (text, JSONL) or row (Parquet) there, from 1
    ("shard", pa.int32()),       # which token shard holds it
    ("token_start", pa.int64()), # its first token within the shard
    ("tokens", pa.int64()),      # token count, the end-of-document token included
    ("byte_start", pa.int64()),  # its bytes within the shard file
    ("byte_end", pa.int64()),
    ("crc32", pa.int64()),       # zlib.crc32 of those bytes
])


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest unsigned dtype that holds every token id."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


@dataclass(frozen=True)
class DatasetMeta:
    tokenizer_hash: str
    vocab_size: int
    eos_id: int
    dtype: str                    # "uint16" | "uint32"
    shards: tuple[str, ...]       # shard files, relative to the dataset URL, in stream order
    shard_tokens: tuple[int, ...] # tokens per shard
    tokenizer: str                # the tokenizer directory, relative to the dataset URL
    documents: int
    tokens: int
    skipped: int                  # inputs left out under --skip-bad
    index_hash: str

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def shard_starts(self) -> np.ndarray:
        """Each shard's first token in the stream, then the stream's length."""
        return np.concatenate([[0], np.cumsum(np.asarray(self.shard_tokens, dtype=np.int64))])


@dataclass(frozen=True)
class DatasetIdentity:
    """What a checkpoint records of the data it was trained on, and a resume compares."""

    url: str
    index_hash: str
    tokenizer_hash: str
    tokenizer_url: str

    def to_dict(self) -> dict:
        return asdict(self)


def index_hash(tokenizer_hash: str, dtype: str, tokens: np.ndarray, checksums: np.ndarray) -> str:
    """Of the token stream alone: how documents were grouped into shards (which depends on the
    CPUs that prepared them) changes neither the samples nor the hash."""
    digest = hashlib.sha256(f"{FORMAT}|{tokenizer_hash}|{dtype}|".encode())
    digest.update(np.asarray(tokens, dtype="<i8").tobytes())
    digest.update(np.asarray(checksums, dtype="<i8").tobytes())
    return digest.hexdigest()[:32]


def encode_index(documents: pa.Table, meta: DatasetMeta) -> bytes:
    document = dict(asdict(meta), format=FORMAT)
    table = documents.cast(INDEX_SCHEMA).replace_schema_metadata({METADATA_KEY: json.dumps(document).encode()})
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def decode_index(data: bytes, where: str) -> tuple[DatasetMeta, pa.Table]:
    """The metadata and document table; refuses an index whose content does not match its hash."""
    try:
        table = pq.read_table(io.BytesIO(data))
        document = json.loads(table.schema.metadata[METADATA_KEY])
    except (pa.ArrowException, KeyError, TypeError, ValueError) as error:
        raise RayshardError(f"{where}: not a rayshard dataset index ({type(error).__name__}). "
                            "Fix: point at the --out URL of `rayshard data prepare`") from None
    if document.pop("format", None) != FORMAT:
        raise RayshardError(f"{where}: dataset format is not {FORMAT}. Fix: prepare it again with this rayshard")
    meta = DatasetMeta(**{**document, "shards": tuple(document["shards"]), "shard_tokens": tuple(document["shard_tokens"])})
    found = index_hash(meta.tokenizer_hash, meta.dtype, table.column("tokens").to_numpy(),
                       table.column("crc32").to_numpy())
    if found != meta.index_hash:
        raise RayshardError(f"{where}: the index's documents hash to {found}, its metadata says {meta.index_hash}; "
                            "the index was edited or is corrupt. Fix: prepare the dataset again")
    return meta, table
