"""Damaged checkpoints fail loudly and say where: a missing or truncated shard names the file and
byte range, a checksum mismatch names the tensor and file, and a changed file is detected even
when only part of a chunk is read."""
import shutil

import pytest

from actors.checkpointing import StoredCheckpoint, read_manifest
from cluster.digest import digest_checkpoint
from plans.errors import CheckpointError
from plans.model_spec import preset
from tests.unit.checkpoint_factory import write_checkpoint

QKV = "layers.1.attention.qkv.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    write_checkpoint(str(root / "store"), "run", preset("tiny"))
    return root / "store"


@pytest.fixture
def checkpoint(pristine, tmp_path):
    """A private copy of one written checkpoint: each test damages its own."""
    shutil.copytree(pristine, tmp_path / "store")
    url = str(tmp_path / "store" / "run" / "checkpoints" / "step-00000002")
    chunks, _ = read_manifest(url)
    chunk = next(c for c in chunks if c.name == QKV and c.kind == "param")
    return url, chunk, tmp_path / "store" / "run" / "checkpoints" / "step-00000002" / chunk.file


def test_a_missing_shard_names_the_file_and_byte_range(checkpoint):
    url, chunk, path = checkpoint
    path.unlink()
    with pytest.raises(CheckpointError, match=rf"{chunk.file}: expected bytes \[\d+, \d+\) of .* missing or truncated"):
        StoredCheckpoint(url).read_region(QKV, "param", (0, 0), (128, 64))


def test_a_truncated_shard_names_the_file_and_byte_range(checkpoint):
    url, chunk, path = checkpoint
    path.write_bytes(path.read_bytes()[:chunk.byte_start + 100])
    with pytest.raises(CheckpointError, match=rf"{chunk.file}: expected bytes \[{chunk.byte_start}, {chunk.byte_end}\)"):
        StoredCheckpoint(url).read_region(QKV, "param", (0, 0), (128, 64))


def test_a_checksum_mismatch_names_the_tensor_and_the_file(checkpoint):
    url, chunk, path = checkpoint
    data = bytearray(path.read_bytes())
    data[chunk.byte_start + 17] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{chunk.file}: checksum mismatch for {QKV} \(param\)"):
        StoredCheckpoint(url).read_region(QKV, "param", (0, 0), (128, 64))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        digest_checkpoint(url)  # a digest run reads every chunk whole: it is also an integrity check


def test_a_rewritten_file_is_detected_even_when_only_part_of_a_chunk_is_read(checkpoint, tmp_path):
    url, chunk, path = checkpoint
    # Another save of the same model writes the same tensors at the same offsets, but its header
    # carries its own nonce: copying it over this file must not pass unnoticed.
    other, _, _ = write_checkpoint(str(tmp_path / "other"), "run", preset("tiny"), seed=5)
    other_chunks, _ = read_manifest(other)
    other_path = tmp_path / "other" / "run" / "checkpoints" / "step-00000002" / other_chunks[0].file
    path.write_bytes(other_path.read_bytes())
    with pytest.raises(CheckpointError, match="safetensors header differs from the one recorded in the manifest"):
        StoredCheckpoint(url).read_region(QKV, "param", (4, 0), (2, 64))  # two rows: no chunk checksum to help


def test_partial_reads_return_exactly_the_stored_rows(checkpoint):
    url, _, _ = checkpoint
    stored = StoredCheckpoint(url)
    whole = stored.read_region(QKV, "param", (0, 0), (128, 64))
    assert (stored.read_region(QKV, "param", (5, 7), (3, 9)) == whole[5:8, 7:16]).all()
