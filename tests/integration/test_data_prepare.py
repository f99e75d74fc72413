"""`data prepare` on Ray: text, JSONL and Parquet from local files and the S3 test server into token
shards whose documents decode back to the input exactly; each kind of bad input named by file and
row, or skipped and counted; the index is the commit."""
import io
import json
import zlib

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rayshard.cluster.cli.main import main
from rayshard.cluster.data.documents import ReadOptions
from rayshard.cluster.data.prepare import prepare_dataset
from rayshard.cluster.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from rayshard.plans.data.dataset_index import INDEX, decode_index
from rayshard.plans.data.errors import DataInputError
from rayshard.plans.errors import RayshardError

CODE = "import os\n\ndef walk(root):\n    for name in os.listdir(root):\n        yield name\n"
DOCS = {"a.txt": CODE * 3, "b.txt": "naïve café — ünïcode ✓\n\nsecond paragraph\n"}
JSONL = [{"text": "first json document", "id": 1}, {"text": "second, with é and 中文", "id": 2}]
PARQUET = ["parquet row one", "parquet row two\nwith a newline", ""]


def _write_inputs(fs, root):
    fs.makedirs(root, exist_ok=True)
    for name, text in DOCS.items():
        fs.pipe_file(f"{root}/{name}", text.encode())
    fs.pipe_file(f"{root}/c.jsonl", "\n".join(json.dumps(r) for r in JSONL).encode() + b"\n")
    sink = io.BytesIO()
    pq.write_table(pa.table({"body": PARQUET, "n": [1, 2, 3]}), sink)
    fs.pipe_file(f"{root}/d.parquet", sink.getvalue())


def expected_documents():
    return list(DOCS.values()) + [r["text"] for r in JSONL] + PARQUET


def decoded_documents(url):
    """Every document of a prepared dataset, read by its index's byte ranges and checked."""
    fs, root = fsspec.core.url_to_fs(url)
    meta, table = decode_index(fs.cat_file(f"{root}/{INDEX}"), url)
    tokenizer = load_tokenizer(f"{url}/{meta.tokenizer}")
    assert tokenizer.hash == meta.tokenizer_hash
    texts = []
    for row in table.to_pylist():
        data = fs.cat_file(f"{root}/{meta.shards[row['shard']]}", start=row["byte_start"], end=row["byte_end"])
        assert zlib.crc32(data) == row["crc32"]
        ids = np.frombuffer(data, dtype=meta.dtype).tolist()
        assert ids[-1] == meta.eos_id and len(ids) == row["tokens"]
        texts.append(tokenizer.tokenizer.decode(ids[:-1], skip_special_tokens=False))
    return meta, table, texts


@pytest.fixture(scope="module")
def local_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inputs")
    _write_inputs(fsspec.filesystem("file"), str(folder))
    loaded = train_tokenizer([str(folder)], 300, ReadOptions(column="body"))
    save_tokenizer(loaded, str(folder / "tok"))
    return folder, load_tokenizer(str(folder / "tok"))


def test_prepare_local_inputs_decode_back_exactly(ray_session, local_tokenizer, tmp_path):
    folder, tokenizer = local_tokenizer
    inputs = [str(folder / name) for name in ("a.txt", "b.txt", "c.jsonl", "d.parquet")]
    summary = prepare_dataset(inputs, tokenizer, str(tmp_path / "ds"), ReadOptions(column="body"), cpus_per_task=0)
    meta, table, texts = decoded_documents(str(tmp_path / "ds"))
    assert texts == expected_documents()
    assert table.column("source").to_pylist()[:2] == inputs[:2]
    assert table.column("row").to_pylist()[2:] == [1, 2, 1, 2, 3]
    assert meta.dtype == "uint16" and meta.vocab_size == tokenizer.vocab_size and meta.skipped == 0
    assert (summary.documents, summary.tokens) == (meta.documents, meta.tokens) == (len(texts), int(table.column("tokens").to_numpy().sum()))
    assert "tokens/s" in summary.line()
    with pytest.raises(RayshardError, match="already holds a prepared dataset"):  # create-only, like a manifest
        prepare_dataset(inputs, tokenizer, str(tmp_path / "ds"), ReadOptions(column="body"), cpus_per_task=0)


def test_the_index_hash_is_the_content(ray_session, local_tokenizer, tmp_path):
    folder, tokenizer = local_tokenizer
    first = prepare_dataset([str(folder / "a.txt")], tokenizer, str(tmp_path / "one"), cpus_per_task=0)
    again = prepare_dataset([str(folder / "a.txt")], tokenizer, str(tmp_path / "two"), cpus_per_task=0)
    other = prepare_dataset([str(folder / "b.txt")], tokenizer, str(tmp_path / "three"), cpus_per_task=0)
    assert first.index_hash == again.index_hash != other.index_hash


def test_stdlib_input_and_max_bytes(tmp_path):
    """`--input stdlib` names the byte-level trainer's corpus; --max-bytes keeps its first files."""
    from rayshard.actors.training.data import stdlib_files
    from rayshard.cluster.data.documents import input_files

    every = input_files(["stdlib"])
    assert [url for url, _ in every] == stdlib_files() and all(size > 0 for _, size in every[:50])
    first = input_files(["stdlib"], max_bytes=every[0][1] + every[1][1] + every[2][1])
    assert first == every[:3]
    assert input_files(["stdlib"], max_bytes=1) == every[:1]  # at least one file


BAD_INPUTS = {
    "non-utf8.txt": (b"good line\nbad \xff byte\n", "non-utf8.txt, row 2: not UTF-8"),
    "empty.txt": (b"", "empty.txt: the file is empty"),
    "missing.jsonl": (b'{"text": "ok"}\n{"other": "no text"}\n', "missing.jsonl, row 2: no field 'text'"),
    "corrupt.parquet": (b"PAR1 this is not parquet PAR1", "corrupt.parquet: not a readable Parquet file"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_is_named_by_file_and_row_or_skipped(ray_session, local_tokenizer, tmp_path, name):
    folder, tokenizer = local_tokenizer
    content, message = BAD_INPUTS[name]
    (tmp_path / name).write_bytes(content)
    inputs = [str(folder / "a.txt"), str(tmp_path / name)]
    with pytest.raises(DataInputError) as error:
        prepare_dataset(inputs, tokenizer, str(tmp_path / "ds"), cpus_per_task=0)
    assert message in str(error.value) and "Fix:" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "ds" / INDEX).exists() and not list((tmp_path / "ds").glob("attempt-*"))
    summary = prepare_dataset(inputs, tokenizer, str(tmp_path / "skipped"), ReadOptions(skip_bad=True), cpus_per_task=0)
    assert len(summary.skipped) == 1 and message in summary.skipped[0]
    _, _, texts = decoded_documents(str(tmp_path / "skipped"))
    assert texts[0] == DOCS["a.txt"] and texts[1:] == (["ok"] if name == "missing.jsonl" else [])


def test_cli_prints_one_line_for_bad_input(ray_session, local_tokenizer, tmp_path, capsys):
    folder, _ = local_tokenizer
    (tmp_path / "bad.txt").write_bytes(b"\xfe\xff")
    code = main(["data", "prepare", "--tokenizer", str(folder / "tok"), "--input", str(tmp_path / "bad.txt"),
                 "--out", str(tmp_path / "ds"), "--cpus-per-task", "0", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "bad.txt, row 1: not UTF-8" in err[0]


def test_tokenizer_and_prepare_on_an_object_store(ray_session, object_store, capsys):
    s3_store = object_store.url  # S3 (moto) and Azure Blob Storage (Azurite)
    fs, root = fsspec.core.url_to_fs(s3_store)
    _write_inputs(fs, f"{root}/in")
    assert main(["data", "tokenizer", "train", "--vocab-size", "300", "--input", f"{s3_store}/in", "--column", "body",
                 "--out", f"{s3_store}/tok", "--quiet"]) == 0
    assert main(["data", "prepare", "--tokenizer", f"{s3_store}/tok", "--input", f"{s3_store}/in/*",
                 "--column", "body", "--out", f"{s3_store}/ds", "--cpus-per-task", "0", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"prepared {s3_store}/ds: 7 documents" in out
    _, _, texts = decoded_documents(f"{s3_store}/ds")
    assert texts == expected_documents()
