"""Damaged checkpoints fail loudly and say where: a missing or truncated shard names the file and
byte range, a checksum mismatch names the tensor and file, and a changed file is detected even
when only part of a chunk is read."""
import shutil

import pytest

from rayshard.storage.manifest_io import read_manifest
from rayshard.actors.checkpoint.read_executor import Destination

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.cluster.checkpoint.digest import digest_checkpoint
from rayshard.plans.errors import CheckpointError
from rayshard.plans.training.model_spec import preset
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


def _flip_byte(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x08
    path.write_bytes(bytes(data))


def test_an_edit_inside_a_chunk_read_in_parts_is_caught_when_the_parts_meet(checkpoint):
    """Two targets each read half of a chunk (a layout change cut it): neither can check it alone,
    and the header fingerprint does not see an edit in place. Their parts' checksums, combined,
    must give the chunk's."""
    url, chunk, path = checkpoint
    clean = StoredCheckpoint(url)
    clean.read_region(QKV, "param", (0, 0), (64, 64))
    clean.read_region(QKV, "param", (64, 0), (64, 64))
    assert clean.check_partial_reads() == 1
    _flip_byte(path, chunk.byte_end - 5)  # in the second half
    stored = StoredCheckpoint(url)
    stored.read_region(QKV, "param", (0, 0), (64, 64))  # each read alone passes
    stored.read_region(QKV, "param", (64, 0), (64, 64))
    with pytest.raises(CheckpointError, match=rf"checksum mismatch in 1 chunk\(s\) read in parts .*{chunk.file}: "
                                              rf"{QKV} \(param\) at bytes \[{chunk.byte_start}, {chunk.byte_end}\)"):
        stored.check_partial_reads()


def test_a_chunk_whose_parts_do_not_cover_it_is_read_whole_to_check_it(checkpoint):
    url, chunk, path = checkpoint
    _flip_byte(path, chunk.byte_end - 5)
    from rayshard.actors.checkpoint.stored import check_loaded_parts

    stored = StoredCheckpoint(url)
    stored.read_region(QKV, "param", (0, 0), (64, 64))  # only the first half, which is intact
    parts = list(stored.partial_reads)
    with pytest.raises(CheckpointError, match=rf"{chunk.file}: checksum mismatch for {QKV} \(param\)"):
        stored.check_partial_reads()
    # The same when the parts come back from ranks: the driver opens the checkpoint to read it whole.
    with pytest.raises(CheckpointError, match=rf"{chunk.file}: checksum mismatch for {QKV} \(param\)"):
        check_loaded_parts(url, [{"partial_reads": parts}])


def test_an_offline_reshard_that_reads_an_edited_chunk_in_parts_commits_nothing(checkpoint, tmp_path):
    from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint
    from rayshard.cluster.catalog.store import Store
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    url, chunk, path = checkpoint
    _flip_byte(path, chunk.byte_start + 3)  # fsdp2 reads the first half of every chunk on one rank
    store = Store(str(tmp_path / "store"))
    with pytest.raises(CheckpointError, match=rf"{QKV} \(param\)"):
        reshard_checkpoint(url, ParallelLayout(fsdp=2), store, "copy", local=True, log=lambda *_: None)
    assert store.committed_steps("copy") == []


def _rewrite_manifest(url: str, keep, extra=()) -> None:
    """The checkpoint's manifest with only the chunks `keep` accepts, plus `extra` ones."""
    from rayshard.plans.checkpoint.manifest.codec import encode_manifest

    chunks, metadata = read_manifest(url)
    metadata.pop("format_version")
    with open(f"{url}/manifest.parquet", "wb") as handle:
        handle.write(encode_manifest([c for c in chunks if keep(c)] + list(extra), metadata))


@pytest.mark.parametrize("damage", ["lost a layer", "gained a tensor"])
def test_offline_tools_name_every_tensor_a_manifest_lost_or_gained(checkpoint, tmp_path, damage):
    """plan, reshard, export and verify check the manifest against the model it records, and say
    everything that is off at once (the reshard used to die with a KeyError on the first one)."""
    import dataclasses

    from rayshard.cluster.checkpoint.hf_interop import export_hf
    from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint
    from rayshard.cluster.checkpoint.reshard_report import build_plan
    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.checkpoint.verify import verify
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    url, chunk, _ = checkpoint
    if damage == "lost a layer":
        _rewrite_manifest(url, lambda c: not c.name.startswith("layers.1."))
        expected = r"missing keys \(18\): layers\.1\.attention\.qkv\.weight \(exp_avg\);"
    else:
        stray = dataclasses.replace(chunk, name="layers.9.attention.qkv.weight")
        _rewrite_manifest(url, lambda c: True, [stray])
        expected = r"unexpected keys \(1\): layers\.9\.attention\.qkv\.weight \(param\)"
    chunks, metadata = read_manifest(url)
    store = Store(str(tmp_path / "store"))
    for run in (lambda: build_plan(chunks, metadata, ParallelLayout(tp=2)),
                lambda: reshard_checkpoint(url, ParallelLayout(tp=2), store, "copy", local=True, log=lambda *_: None),
                lambda: export_hf(url, str(tmp_path / "hf"), log=lambda *_: None)):
        with pytest.raises(CheckpointError, match=rf"does not match the model: {expected}.*Fix: ") as refused:
            run()
        assert "\n" not in str(refused.value)
    assert store.committed_steps("copy") == []
    problems = verify(url).problems
    assert len(problems) == 1 and "does not match the model" in problems[0] and "manifest:" in problems[0]


@pytest.mark.parametrize("window", [2**26, 3000])  # whole requests, and parts bigger than the window (row blocks)
def test_parts_read_from_an_object_store_are_verified_together_too(tmp_path, window):
    """The object-store path (`_serve`, `_serve_large`) reports parts as the local one does."""
    import uuid

    import fsspec
    import torch

    from rayshard.plans.checkpoint.reshard import Target

    store_url = f"memory://parts-{uuid.uuid4().hex}"
    url, _, _ = write_checkpoint(store_url, "run", preset("tiny"))
    chunk = next(c for c in read_manifest(url)[0] if c.name == QKV and c.kind == "param")
    halves = [Target(QKV, "param", (0, 0), (64, 64)), Target(QKV, "param", (64, 0), (64, 64))]

    def read_both() -> StoredCheckpoint:
        stored = StoredCheckpoint(url)
        stored.read({t: Destination(torch.empty(t.sizes), t.offsets) for t in halves}, window_bytes=window)
        return stored

    assert read_both().check_partial_reads() == 1
    fs, base = fsspec.core.url_to_fs(url)
    data = bytearray(fs.cat_file(f"{base}/{chunk.file}"))
    data[chunk.byte_start + 70 * 64 * 4 + 3] ^= 0x20  # a row of the second half
    fs.pipe_file(f"{base}/{chunk.file}", bytes(data))
    with pytest.raises(CheckpointError, match=rf"read in parts .*{QKV} \(param\)"):
        read_both().check_partial_reads()


def test_verify_reports_damaged_model_metadata_instead_of_crashing(checkpoint):
    from rayshard.plans.checkpoint.manifest.codec import encode_manifest
    from rayshard.cluster.checkpoint.verify import verify

    url, _, _ = checkpoint
    chunks, metadata = read_manifest(url)
    for damaged in ("tiny", {"n_heads": 0}, {"dim": "64"}):
        document = {key: value for key, value in metadata.items() if key != "format_version"}
        document["model"] = damaged
        with open(f"{url}/manifest.parquet", "wb") as handle:
            handle.write(encode_manifest(chunks, document))
        problems = verify(url).problems
        assert len(problems) == 1 and "its `model` metadata does not describe a model" in problems[0], damaged
