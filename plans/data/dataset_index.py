"""A prepared dataset's index: one Parquet row per document, its metadata, and their codec.

    URL/index.parquet                          the commit: created last, create-only
    URL/attempt-<id>/shard-00000.tokens        little-endian uint16 or uint32 token ids, no header
    URL/attempt-<id>/shard-00000.mask          SFT datasets only: one uint8 loss mask per token (1: completion)
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
TEXT, SFT = "text", "sft"  # what a dataset's documents are: text to pack, or examples with loss masks
# Preference pairs: documents 2i and 2i + 1 are pair i's chosen and rejected examples (prompt +
# response + end of document), each with its loss mask on the response, as an SFT example's.
PREFERENCE = "preference"
MASKED_KINDS = (SFT, PREFERENCE)  # kinds whose shards carry .mask files and whose index has SFT_INDEX_SCHEMA
# An SFT dataset's index: each document is one example (prompt tokens, completion tokens, end of
# document), its loss mask stored beside it in the shard's .mask file at the same token offsets.
SFT_INDEX_SCHEMA = pa.schema([
    *INDEX_SCHEMA,
    ("loss_tokens", pa.int64()),  # targets the loss counts: mask ones at positions 1.. (position 0 is never a target)
    ("mask_crc32", pa.int64()),   # zlib.crc32 of the example's mask bytes
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
    kind: str = TEXT              # TEXT | SFT | PREFERENCE (datasets prepared before SFT existed are text)
    masks: tuple[str, ...] = ()   # SFT: each shard's mask file, relative to the dataset URL
    longest: int = 0              # SFT: the longest example's tokens (a sample must hold it)

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


def index_hash(tokenizer_hash: str, dtype: str, tokens: np.ndarray, checksums: np.ndarray,
               loss_tokens: np.ndarray | None = None, mask_checksums: np.ndarray | None = None,
               kind: str = SFT) -> str:
    """Of the token stream alone: how documents were grouped into shards (which depends on the
    CPUs that prepared them) changes neither the samples nor the hash. An SFT dataset's masks
    (their checksums and per-example counts) are hashed too; a text dataset's hash is as it was."""
    digest = hashlib.sha256(f"{FORMAT}|{tokenizer_hash}|{dtype}|".encode())
    digest.update(np.asarray(tokens, dtype="<i8").tobytes())
    digest.update(np.asarray(checksums, dtype="<i8").tobytes())
    if mask_checksums is not None:
        digest.update(f"|{kind}|".encode())  # a preference dataset never hashes as the SFT one of the same examples
        digest.update(np.asarray(loss_tokens, dtype="<i8").tobytes())
        digest.update(np.asarray(mask_checksums, dtype="<i8").tobytes())
    return digest.hexdigest()[:32]


def table_hash(meta_tokenizer_hash: str, dtype: str, kind: str, table: pa.Table) -> str:
    """index_hash of a document table of either kind."""
    column = lambda name: table.column(name).to_numpy()  # noqa: E731
    if kind in MASKED_KINDS:
        return index_hash(meta_tokenizer_hash, dtype, column("tokens"), column("crc32"), column("loss_tokens"),
                          column("mask_crc32"), kind)
    return index_hash(meta_tokenizer_hash, dtype, column("tokens"), column("crc32"))


def encode_index(documents: pa.Table, meta: DatasetMeta) -> bytes:
    document = dict(asdict(meta), format=FORMAT)
    schema = SFT_INDEX_SCHEMA if meta.kind in MASKED_KINDS else INDEX_SCHEMA
    table = documents.cast(schema).replace_schema_metadata({METADATA_KEY: json.dumps(document).encode()})
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
    meta = DatasetMeta(**{**document, "shards": tuple(document["shards"]), "shard_tokens": tuple(document["shard_tokens"]),
                          "masks": tuple(document.get("masks", ()))})
    if (meta.kind not in (TEXT, *MASKED_KINDS) or (meta.kind in MASKED_KINDS and len(meta.masks) != len(meta.shards))
            or (meta.kind == PREFERENCE and meta.documents % 2)):
        raise RayshardError(f"{where}: unknown dataset kind {meta.kind!r} or masks missing. "
                            "Fix: prepare it again with this rayshard")
    found = table_hash(meta.tokenizer_hash, meta.dtype, meta.kind, table)
    if found != meta.index_hash:
        raise RayshardError(f"{where}: the index's documents hash to {found}, its metadata says {meta.index_hash}; "
                            "the index was edited or is corrupt. Fix: prepare the dataset again")
    return meta, table
