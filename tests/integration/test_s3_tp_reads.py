"""Reads at tp on an object store (issue 42 item 6, docs/decisions.md 146): real Ray ranks load a
checkpoint from the S3 test server onto a tp that cuts the row-parallel weights' stored rows.
Their tp group reads each band of whole rows once, a disjoint share per rank, and scatters the
column slices, so the load reads at most 1.05x the bytes its ranks hold (before: every tp rank
read `wo` and `down` whole), bit-exact by digests, and a corrupt byte in a chunk read this way
still fails the load naming the chunk."""
from __future__ import annotations

import pytest

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint
from rayshard.cluster.run.rank_group import RankGroup
from rayshard.plans.config import ModelChoice
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.storage.manifest_io import read_manifest
from tests.conftest import small_config
from tests.integration.reshard_helpers import digests, load_and_save
from tests.unit.checkpoint_factory import write_checkpoint

LIMIT = 1.05
# Divisible by tp 2, 3 and 4 everywhere; rows of a few hundred bytes, far below the 256 KiB under
# which an object store reads a column slice's row segments as whole rows.
MODEL = ModelChoice.named("tiny", vocab_size=96, dim=48, n_heads=12, n_kv_heads=12, ffn_dim=96, n_layers=2)


def _source(s3_store, layout: ParallelLayout, run: str) -> str:
    """A checkpoint written by one rank, resharded onto `layout` on the S3 server."""
    url, _, _ = write_checkpoint(s3_store, f"{run}-one", MODEL.spec)
    if layout.world_size == 1:
        return url
    return reshard_checkpoint(url, layout, Store(s3_store), run, local=True, log=lambda *_: None).url


def _config(tmp_path, s3_store, layout, run):
    return small_config(tmp_path, layout, model=MODEL, store=s3_store, run=run, global_batch=12)


def _load_reads_at_most_1_05x(rank_pool, tmp_path, s3_store, source: ParallelLayout, target: ParallelLayout):
    url = _source(s3_store, source, "src")
    loaded = []
    again = load_and_save(_config(tmp_path, s3_store, target, "again"), url, rank_pool, loaded)
    assert digests(again) == digests(url)  # bit-exact: every tensor and moment
    chunks, _ = read_manifest(again)
    held = sum(c.byte_end - c.byte_start for c in chunks)  # what the target ranks hold, each region once
    files = len(read_manifest(url)[0].file_names())
    headers = target.world_size * files * 4096  # a header check per rank and file read in part, generously
    read = sum(result["bytes_read"] for result in loaded)
    assert read <= LIMIT * held + headers, (read, held)
    assert sum(result["bytes_received"] for result in loaded) > 0  # the column slices were handed over


def test_a_tp3_load_from_one_rank_on_s3_reads_at_most_1_05x_bit_exact(rank_pool, tmp_path, s3_store):
    _load_reads_at_most_1_05x(rank_pool, tmp_path, s3_store, ParallelLayout(), ParallelLayout(tp=3))


@pytest.mark.slow
@pytest.mark.parametrize("source,target", [(ParallelLayout(tp=2), ParallelLayout(tp=4)),
                                           (ParallelLayout(fsdp=2), ParallelLayout(tp=3)),
                                           (ParallelLayout(tp=2), ParallelLayout(dp=2, tp=3)),
                                           (ParallelLayout(tp=3), ParallelLayout(fsdp=2, tp=2))],
                         ids=["tp2->tp4", "fsdp2->tp3", "tp2->dp2xtp3", "tp3->fsdp2xtp2"])
def test_more_tp_loads_on_s3_read_at_most_1_05x_bit_exact(rank_pool, tmp_path, s3_store, source, target):
    _load_reads_at_most_1_05x(rank_pool, tmp_path, s3_store, source, target)


def test_a_corrupt_byte_in_a_banded_chunk_fails_the_load_naming_it(rank_pool, tmp_path, s3_store):
    url = _source(s3_store, ParallelLayout(tp=2), "corrupt")
    chunks, _ = read_manifest(url)
    wo = next(c for c in chunks if c.name == "layers.0.attention.wo.weight" and c.kind == "param")
    store = Store(s3_store)
    path = f"{url.removeprefix('s3://')}/{wo.file}"
    data = bytearray(store.fs.cat_file(path))
    data[wo.byte_start + 4 * 10] ^= 0x40  # row 0, column 10
    store.fs.pipe_file(path, bytes(data))
    config = _config(tmp_path, s3_store, ParallelLayout(tp=3), "corrupt-again")
    group = RankGroup(config, rank_pool)
    try:
        group.call("configure_storage", store.storage_conf)
        with pytest.raises(Exception) as failed:
            from rayshard.actors.checkpoint.stored import check_loaded_parts

            check_loaded_parts(url, group.call_reporting_failures("load", url))
    finally:
        group.shutdown()
    assert "layers.0.attention.wo.weight (param)" in str(failed.value), failed.value
    # Found where the three ranks' disjoint parts of the chunk meet (before banding every tp rank
    # read the chunk whole, and the first to finish named it alone).
    assert "read in parts by several ranks" in str(failed.value)


def test_a_corrupt_chunk_a_member_reads_whole_fails_it_and_every_member_is_told(rank_pool, tmp_path, s3_store):
    """fsdp4 -> tp2: each member's share of `wo`'s band holds two whole fsdp chunks, read whole and
    verified as they land. The member reading the corrupt one names it; it still takes part in
    every scatter, so its peer, whose columns it would have sent, is told the load failed instead
    of waiting (every rank answers)."""
    from rayshard.plans.errors import StepFailed

    url = _source(s3_store, ParallelLayout(fsdp=4), "whole")
    chunks, _ = read_manifest(url)
    wo = next(c for c in chunks if c.name == "layers.0.attention.wo.weight" and c.kind == "param")
    store = Store(s3_store)
    path = f"{url.removeprefix('s3://')}/{wo.file}"
    data = bytearray(store.fs.cat_file(path))
    data[(wo.byte_start + wo.byte_end) // 2] ^= 0xFF
    store.fs.pipe_file(path, bytes(data))
    group = RankGroup(_config(tmp_path, s3_store, ParallelLayout(tp=2), "whole-again"), rank_pool)
    try:
        group.call("configure_storage", store.storage_conf)
        with pytest.raises(StepFailed) as failed:
            group.call_reporting_failures("load", url)
    finally:
        group.shutdown()
    errors = failed.value.failures
    assert failed.value.silent == [] and sorted(errors) == [0, 1], errors
    named = [rank for rank, message in errors.items() if "checksum mismatch for layers.0.attention.wo.weight (param)" in message]
    assert len(named) == 1, errors  # one member read the chunk, whole
    assert "a replica of this rank could not load" in errors[1 - named[0]], errors
