"""A damaged token shard is refused when a rank reads it: every document a read holds whole is
checked against the index's CRC32, on a local store and on the S3 test server."""
import json

import fsspec
import numpy as np
import pytest

from rayshard.actors.training.dataset_reader import PreparedDataset
from rayshard.cluster.data.documents import ReadOptions
from rayshard.cluster.data.prepare import prepare_dataset
from rayshard.cluster.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from rayshard.storage import options as storage_options
from rayshard.plans.data.dataset_index import INDEX, decode_index
from rayshard.plans.errors import RayshardError

SEQ_LEN = 64
LINES = [{"text": f"record {i}: {'abcdefgh'[i % 8] * (3 + i % 5)} value={i * 37 % 101}"} for i in range(120)]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checksum-inputs")
    (folder / "docs.jsonl").write_text("\n".join(json.dumps(line) for line in LINES) + "\n")
    save_tokenizer(train_tokenizer([str(folder / "docs.jsonl")], 280), str(folder / "tok"))
    return folder, load_tokenizer(str(folder / "tok"))


def _damage_and_read(url: str):
    fs, root = fsspec.core.url_to_fs(url)
    meta, table = decode_index(fs.cat_file(f"{root}/{INDEX}"), url)
    reader = PreparedDataset(url, SEQ_LEN)
    everything = reader.read_samples(np.arange(reader.samples))  # intact: every check passes
    assert reader.checks.checked >= len(LINES) // 2
    # A document inside one window (token range [a, b) within [i*S, i*S + S + 1)): reads hold it whole.
    documents = table.to_pylist()
    starts = np.asarray(meta.shard_starts)
    for doc in documents:
        a = int(starts[doc["shard"]]) + doc["token_start"]
        if a // SEQ_LEN * SEQ_LEN + SEQ_LEN + 1 >= a + doc["tokens"] and doc["tokens"] > 2:
            break
    shard = f"{root}/{meta.shards[doc['shard']]}"
    data = bytearray(fs.cat_file(shard))
    data[doc["byte_start"] + 1] ^= 0x01  # one bit of the document's first token
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(RayshardError) as error:
        PreparedDataset(url, SEQ_LEN).read_samples(np.asarray([a // SEQ_LEN]))
    return everything, doc, str(error.value)


def test_a_damaged_local_shard_is_refused_naming_file_and_document(ray_session, tokenizer, tmp_path):
    folder, loaded = tokenizer
    prepare_dataset([str(folder / "docs.jsonl")], loaded, str(tmp_path / "ds"), cpus_per_task=0)
    _, doc, message = _damage_and_read(str(tmp_path / "ds"))
    assert f"{tmp_path / 'ds'}/" in message and ".tokens" in message and f"docs.jsonl, row {doc['row']}" in message
    assert "CRC32" in message and "Fix:" in message and "\n" not in message


def test_a_damaged_s3_shard_is_refused(ray_session, tokenizer, s3_store):
    folder, loaded = tokenizer
    storage_options.configure()
    fs, root = fsspec.core.url_to_fs(s3_store)
    fs.pipe_file(f"{root}/in/docs.jsonl", (folder / "docs.jsonl").read_bytes())
    prepare_dataset([f"{s3_store}/in/docs.jsonl"], loaded, f"{s3_store}/ds", ReadOptions(), cpus_per_task=0)
    _, doc, message = _damage_and_read(f"{s3_store}/ds")
    assert f"{root}/ds/" in message and f"docs.jsonl, row {doc['row']}" in message and "CRC32" in message
