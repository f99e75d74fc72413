"""The pure half of prepared datasets: sample order, packing, the index codec, the batch hash."""
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayshard.plans.data.batch_hash import global_batch_hash
from rayshard.plans.data.dataset_index import (INDEX_SCHEMA, DatasetMeta, decode_index, encode_index, index_hash,
                                      token_dtype_for)
from rayshard.plans.data.packing import TokenRead, sample_count, sample_reads
from rayshard.plans.data.sample_order import batch_sample_ids, permuted
from rayshard.plans.errors import RayshardError


@settings(max_examples=40, deadline=None)
@given(count=st.integers(1, 3000), seed=st.integers(0, 2**31), epoch=st.integers(0, 5))
def test_each_epoch_is_a_permutation_of_all_samples(count, seed, epoch):
    images = permuted(np.arange(count), count, seed, epoch)
    assert sorted(images.tolist()) == list(range(count))


def test_order_is_a_pure_function_of_seed_and_step_and_shuffled():
    count = 1000
    first = batch_sample_ids(7, 3, 16, count)
    assert np.array_equal(first, batch_sample_ids(7, 3, 16, count))
    assert not np.array_equal(first, batch_sample_ids(8, 3, 16, count))
    assert not np.array_equal(first, batch_sample_ids(7, 4, 16, count))
    steps = np.concatenate([batch_sample_ids(7, s, 10, 100) for s in range(10)])  # one epoch exactly
    assert sorted(steps.tolist()) == list(range(100)) and not np.array_equal(steps, np.arange(100))
    assert not np.array_equal(batch_sample_ids(7, 10, 10, 100), steps[:10])  # epoch 1 has its own order


def test_batches_that_straddle_epochs():
    ids = batch_sample_ids(1, 1, 8, 5)  # positions 8..15: epochs 1, 2 and 3
    assert ids.shape == (8,) and ids.min() >= 0 and ids.max() < 5


def test_sample_reads_cross_shard_boundaries():
    starts = np.array([0, 10, 25, 40])  # shards of 10, 15 and 15 tokens
    assert sample_count(40, 4) == 9
    assert sample_reads(0, 4, starts) == [TokenRead(0, 0, 5)]
    assert sample_reads(2, 4, starts) == [TokenRead(0, 8, 10), TokenRead(1, 0, 3)]
    assert sample_reads(6, 4, starts) == [TokenRead(1, 14, 15), TokenRead(2, 0, 4)]
    assert sample_reads(8, 4, starts) == [TokenRead(2, 7, 12)]
    with pytest.raises(ValueError, match="past the stream"):
        sample_reads(9, 4, starts)


def _index(tokens=(3, 4, 5)):
    counts = np.array(tokens)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    table = pa.Table.from_pydict({"source": ["a"] * len(counts), "row": list(range(1, len(counts) + 1)),
                                  "shard": [0] * len(counts), "token_start": starts, "tokens": counts,
                                  "byte_start": starts * 2, "byte_end": (starts + counts) * 2,
                                  "crc32": [11, 22, 33][:len(counts)]}, schema=INDEX_SCHEMA)
    meta = DatasetMeta("tokhash", 300, 0, "uint16", ("attempt-x/shard-00000.tokens",), (int(counts.sum()),),
                       "attempt-x/tokenizer", len(counts), int(counts.sum()), 0,
                       index_hash("tokhash", "uint16", counts, table.column("crc32").to_numpy()))
    return table, meta


def test_index_codec_round_trips_and_refuses_an_edited_index():
    table, meta = _index()
    decoded, documents = decode_index(encode_index(table, meta), "mem://ds/index.parquet")
    assert decoded == meta and documents.column("tokens").to_pylist() == [3, 4, 5]
    assert list(decoded.shard_starts) == [0, 12]
    edited = table.set_column(table.schema.get_field_index("tokens"), "tokens", pa.array([3, 4, 6]))
    with pytest.raises(RayshardError, match="edited or is corrupt"):
        decode_index(encode_index(edited, meta), "mem://ds/index.parquet")
    with pytest.raises(RayshardError, match="not a rayshard dataset index"):
        decode_index(b"PAR1 nonsense", "mem://ds/index.parquet")


def test_token_dtype_by_vocabulary():
    assert token_dtype_for(300) == "uint16" and token_dtype_for(65536) == "uint16"
    assert token_dtype_for(65537) == "uint32" and token_dtype_for(151_936) == "uint32"


def test_global_batch_hash_does_not_depend_on_the_split():
    rows = [f"{i:016x}" for i in range(8)]
    whole = global_batch_hash([",".join(rows)])
    assert global_batch_hash([",".join(rows[:4]), ",".join(rows[4:])]) == whole
    assert global_batch_hash([",".join(rows[i:i + 2]) for i in range(0, 8, 2)]) == whole
    assert global_batch_hash([",".join(rows[4:]), ",".join(rows[:4])]) != whole
    assert global_batch_hash([]) == ""
