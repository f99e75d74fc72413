"""Manifest and shard files: round trip, version gate, truncated and changed files, no pickle."""
import fsspec
import pytest
import torch

from rayshard.actors.checkpoint.read_executor import fill_from_reads

from rayshard.actors.checkpoint.read_executor import Destination
from rayshard.actors.checkpoint.shard_writer import Piece, encode_shard

from rayshard.plans.checkpoint.manifest.codec import FORMAT_VERSION, decode_manifest, encode_manifest
from rayshard.plans.errors import CheckpointError
from rayshard.plans.checkpoint.reshard import plan_reads


def _written(tmp_path):
    weight = torch.arange(20, dtype=torch.float32).reshape(5, 4) - 7.5
    data, chunks = encode_shard([Piece("w", "param", weight, (5, 4), (0, 0)),
                                 Piece("w", "exp_avg", weight * 2, (5, 4), (0, 0))], "attempt-x/rank-00000.safetensors")
    (tmp_path / "attempt-x").mkdir()
    (tmp_path / "attempt-x" / "rank-00000.safetensors").write_bytes(data)
    return weight, chunks


def test_manifest_round_trip_keeps_chunks_and_metadata(tmp_path):
    _, chunks = _written(tmp_path)
    decoded, metadata = decode_manifest(encode_manifest(chunks, {"step": 3, "layout": {"dp": 2}}))
    assert decoded == chunks and metadata["step"] == 3 and metadata["format_version"] == FORMAT_VERSION


def test_unknown_major_version_is_rejected_clearly(tmp_path):
    _, chunks = _written(tmp_path)
    import io, json
    import pyarrow.parquet as pq

    table = pq.read_table(io.BytesIO(encode_manifest(chunks, {"step": 1})))

    def with_version(version):
        document = json.loads(table.schema.metadata[b"rayshard"])
        document.pop("format_version")
        if version is not None:
            document["format_version"] = version
        sink = io.BytesIO()
        pq.write_table(table.replace_schema_metadata({b"rayshard": json.dumps(document).encode()}), sink)
        return sink.getvalue()

    with pytest.raises(CheckpointError, match="format version 9.0 is not readable .* upgrade rayshard"):
        decode_manifest(with_version("9.0"))
    for damaged in ("abc", "", "2", "1.0.0", None):  # not a version a reader could upgrade to
        with pytest.raises(CheckpointError, match="is not MAJOR.MINOR: the manifest is damaged"):
            decode_manifest(with_version(damaged))
    assert decode_manifest(with_version("2.0"))[0] == chunks  # every minor version of a known major
    with pytest.raises(CheckpointError, match="not a readable Parquet"):
        decode_manifest(b"garbage")


def test_truncated_shard_names_file_and_byte_range(tmp_path):
    _, chunks = _written(tmp_path)
    path = tmp_path / "attempt-x" / "rank-00000.safetensors"
    path.write_bytes(path.read_bytes()[: chunks[1].byte_start + 10])
    fs = fsspec.filesystem("file")
    items = plan_reads([chunks[1]], (0, 0), (5, 4))
    with pytest.raises(CheckpointError, match=rf"rank-00000.safetensors: expected bytes \[{chunks[1].byte_start}, "):
        fill_from_reads(fs, str(tmp_path), items, torch.empty(5, 4), (0, 0))


def test_changed_bytes_fail_the_checksum_naming_tensor_and_file(tmp_path):
    _, chunks = _written(tmp_path)
    path = tmp_path / "attempt-x" / "rank-00000.safetensors"
    data = bytearray(path.read_bytes())
    data[chunks[0].byte_start + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    items = plan_reads([chunks[0]], (0, 0), (5, 4))
    with pytest.raises(CheckpointError, match=r"checksum mismatch for w \(param\)"):
        fill_from_reads(fsspec.filesystem("file"), str(tmp_path), items, torch.empty(5, 4), (0, 0))


def test_shard_files_are_plain_safetensors_without_pickle(tmp_path):
    weight, _ = _written(tmp_path)
    from safetensors.torch import load_file

    loaded = load_file(str(tmp_path / "attempt-x" / "rank-00000.safetensors"))
    assert torch.equal(loaded["param/w@0,0"], weight)
    raw = (tmp_path / "attempt-x" / "rank-00000.safetensors").read_bytes()
    assert b"\x80\x04" not in raw[:64]  # no pickle protocol header


def _with_checksums(chunks, data: bytes, algorithm: str):
    """The same chunks as a writer using `algorithm` would have recorded them."""
    import dataclasses

    from rayshard.storage.checksums import checksum

    header = checksum(data[:min(c.byte_start for c in chunks)], algorithm)
    return [dataclasses.replace(c, checksum=checksum(data[c.byte_start:c.byte_end], algorithm), file_header=header)
            for c in chunks]


def test_new_checkpoints_use_crc32_and_format_2_0_crc32c_ones_still_read_and_fail_on_change(tmp_path):
    weight, chunks = _written(tmp_path)
    assert all(c.checksum.startswith("crc32:") and c.file_header.startswith("crc32:") for c in chunks)
    path = tmp_path / "attempt-x" / "rank-00000.safetensors"
    old = _with_checksums(chunks, path.read_bytes(), "crc32c")  # what format 2.0 wrote
    assert old[0].checksum != chunks[0].checksum and old[0].checksum.startswith("crc32c:")
    fs = fsspec.filesystem("file")
    target = torch.empty(5, 4)
    fill_from_reads(fs, str(tmp_path), plan_reads([old[1]], (0, 0), (5, 4)), target, (0, 0))
    assert torch.equal(target, weight * 2)
    data = bytearray(path.read_bytes())
    data[old[1].byte_start + 3] ^= 0x01
    path.write_bytes(bytes(data))
    for recorded in (old[1], chunks[1]):  # 2.0's CRC32C and 2.1's CRC32 both catch it
        with pytest.raises(CheckpointError, match=r"checksum mismatch for w \(exp_avg\)"):
            fill_from_reads(fs, str(tmp_path), plan_reads([recorded], (0, 0), (5, 4)), target, (0, 0))


def test_written_crc32_values_are_zlibs_so_any_crc32_reader_verifies_them():
    """Format 1.x readers (and anything else that knows CRC32) check 2.1 checkpoints with zlib:
    ISA-L must give the same values, from any starting value and across block boundaries, on
    unaligned buffers and on a tensor's own bytes."""
    import zlib

    from rayshard.storage.checksums import RunningChecksum, checksum

    data = bytes((i * 131 + i // 7) % 251 for i in range(3 * 2**20 + 13))
    assert checksum(data) == f"crc32:{zlib.crc32(data):08x}"
    running = RunningChecksum()
    for start in range(0, len(data), 65_537):  # odd block sizes: the running value carries across
        running.update(memoryview(data)[start:start + 65_537])
    assert running.text() == f"crc32:{zlib.crc32(data):08x}"
    assert checksum(memoryview(data)[3:1003]) == f"crc32:{zlib.crc32(data[3:1003]):08x}"
    tensor = torch.arange(1000, dtype=torch.float32) * 0.37 - 11
    assert checksum(memoryview(tensor.numpy()).cast("B")) == f"crc32:{zlib.crc32(tensor.numpy().tobytes()):08x}"


def test_a_checksum_algorithm_this_reader_does_not_know_is_named(tmp_path):
    import dataclasses

    _, chunks = _written(tmp_path)
    unknown = dataclasses.replace(chunks[0], checksum="sha999:0011")
    with pytest.raises(CheckpointError, match=r"uses 'sha999', which this rayshard cannot verify"):
        fill_from_reads(fsspec.filesystem("file"), str(tmp_path), plan_reads([unknown], (0, 0), (5, 4)),
                        torch.empty(5, 4), (0, 0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(7, 10), (5, 4, 6)])
@pytest.mark.parametrize("short_reads", [False, True])
def test_column_chunks_land_in_rows_of_a_wider_target(tmp_path, monkeypatch, dtype, shape, short_reads):
    """Chunks split along the last dim read into a target split along the first: staged a block
    of rows at a time (blocks of 16 bytes here, so a part takes several) and copied into place, bit
    for bit, checksums verified; truncation and changes still fail.
    short_reads: the system returns at most 7 bytes a call (as FUSE mounts and >2 GiB reads do)."""
    import os

    from rayshard.actors.checkpoint import read_executor
    from rayshard.actors.checkpoint.read_executor import _direct_buffer

    monkeypatch.setattr(read_executor, "CHECK_BLOCK_BYTES", 16)

    if short_reads:
        def preadv_seven_bytes(descriptor, buffers, offset):  # any writable buffers, as os.preadv takes
            first = memoryview(buffers[0]).cast("B")
            data = os.pread(descriptor, min(7, first.nbytes), offset)
            first[:len(data)] = data
            return len(data)

        monkeypatch.setattr(read_executor.os, "preadv", preadv_seven_bytes)

    whole = (torch.arange(torch.Size(shape).numel()) * 7 % 23 - 11).reshape(shape).to(dtype)
    cut = shape[-1] // 2 + 1  # uneven halves
    pieces = [Piece("w", "param", whole[..., :cut].contiguous(), shape, (0,) * (len(shape) - 1) + (0,)),
              Piece("w", "param", whole[..., cut:].contiguous(), shape, (0,) * (len(shape) - 1) + (cut,))]
    data, chunks = encode_shard(pieces, "rank-00000.safetensors")
    path = tmp_path / "rank-00000.safetensors"
    path.write_bytes(data)
    offsets, sizes = (1,) + (0,) * (len(shape) - 1), (shape[0] - 2,) + tuple(shape[1:])
    items = plan_reads(chunks, offsets, sizes)
    target = torch.full(sizes, -1).to(dtype)
    assert all(_direct_buffer(item, Destination(target, offsets)) is None for item in items)  # the staged path
    fs = fsspec.filesystem("file")
    fill_from_reads(fs, str(tmp_path), items, target, offsets)
    assert torch.equal(target, whole[1:shape[0] - 1])
    changed = bytearray(data)
    changed[chunks[1].byte_start + 1] ^= 0x10
    path.write_bytes(bytes(changed))
    with pytest.raises(CheckpointError, match=r"checksum mismatch for w \(param\)"):
        fill_from_reads(fs, str(tmp_path), plan_reads(chunks, (0,) * len(shape), shape), torch.empty(shape, dtype=dtype),
                        (0,) * len(shape))
    path.write_bytes(data[:chunks[1].byte_start + (chunks[1].byte_end - chunks[1].byte_start) // 2])
    with pytest.raises(CheckpointError, match="missing or truncated"):
        fill_from_reads(fs, str(tmp_path), items, target, offsets)
