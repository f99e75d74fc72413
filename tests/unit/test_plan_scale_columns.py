"""Issue 24 at the scale of a unit test: the column-wise dry run (`plans/checkpoint/layout_plan.py`)
against `plan_rank` rank by rank, its failures worded by `plan_rank`, the columnar targets against
`layout_targets`, and rank tables shipped to the driver (pickled, as Ray does) gathered into the
same manifest."""
import pickle
from dataclasses import replace

import numpy as np
import pytest

from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.checkpoint.chunks import STATE_KINDS, Chunk
from rayshard.plans.checkpoint.layout_plan import plan_layout
from rayshard.plans.checkpoint.manifest.codec import chunk_key, decode_manifest, encode_manifest
from rayshard.plans.checkpoint.regions import layout_target_table, layout_targets, pipeline_partition
from rayshard.plans.checkpoint.reshard import header_checks, index_chunks, plan_rank
from rayshard.plans.checkpoint.safetensors_layout import Entry, file_layout
from rayshard.plans.checkpoint.target_table import TargetTable
from rayshard.plans.checkpoint.writers import predicted_writes
from rayshard.plans.errors import CheckpointError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import ModelConfig, preset

TIED = ModelConfig(vocab_size=16, dim=8, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=12, tie_embeddings=True).validate()


def manifest_of(model, layout) -> list[Chunk]:
    """The chunks a save in `layout` writes, with byte ranges of the real safetensors layout and
    made-up checksums (no bytes exist)."""
    partition = pipeline_partition(model, layout) if layout.pp > 1 else None
    chunks = []
    for rank, pieces in enumerate(predicted_writes(model, layout, partition, STATE_KINDS, "float32")):
        file = f"attempt-0/rank-{rank:05d}.safetensors"
        entries = [Entry(chunk_key(p.region.name, p.kind, p.region.offsets), "float32", p.region.sizes) for p in pieces]
        if not entries:
            continue
        _, ranges = file_layout(entries, {"nonce": f"{rank:08x}"})
        chunks += [Chunk(p.region.name, p.kind, "float32", p.region.global_shape, p.region.offsets, p.region.sizes, file,
                         start, end, f"crc32:{start:08x}", f"crc32:{rank:08x}") for p, (start, end) in zip(pieces, ranges)]
    return chunks


def targets_of(model, layout, read_once=True):
    partition = pipeline_partition(model, layout) if layout.pp > 1 else None
    return layout_target_table(model, layout, STATE_KINDS, partition, read_once)


CASES = [("dp=2", "tp=2"), ("tp=2", "tp=4"), ("fsdp=2,tp=2", "fsdp=3,pp=2"), ("dp=2,fsdp=2,tp=2,pp=2", "dp=3,tp=2,pp=2"),
         ("fsdp=4", "dp=2,fsdp=3,tp=2"), ("tp=4,pp=2", "fsdp=3,tp=2,pp=2,vpp=2"), ("fsdp=5", "fsdp=3")]


@pytest.mark.parametrize("model", [preset("tiny"), TIED], ids=["tiny", "tied"])
@pytest.mark.parametrize("source, target", CASES)
@pytest.mark.parametrize("min_segment_bytes", [1, 256 * 1024])  # 1: every column split read row by row
def test_column_wise_totals_are_plan_ranks_rank_by_rank(model, source, target, min_segment_bytes):
    source, target = ParallelLayout.parse(source), ParallelLayout.parse(target)
    chunks = manifest_of(model, source)
    for read_once in (True, False):
        targets = targets_of(model, target, read_once)
        partition = pipeline_partition(model, target) if target.pp > 1 else None
        assert targets.as_lists() == layout_targets(model, target, STATE_KINDS, partition, read_once)
        plan = plan_layout(ChunkTable.from_chunks(chunks), targets, min_segment_bytes)
        index, headers = index_chunks(chunks), header_checks(chunks)
        expected = [plan_rank(index, targets.targets_of(rank), rank, headers, min_segment_bytes)
                    for rank in range(target.world_size)]
        assert plan.rank_bytes_read.tolist() == [r.bytes_read for r in expected]
        assert plan.rank_requests.tolist() == [len(r.requests) for r in expected]
        assert plan.rank_files.tolist() == [r.files for r in expected]
        assert plan.rank_bytes_needed.tolist() == [r.bytes_needed for r in expected]
        assert plan.rank_bytes_received.tolist() == [r.bytes_received for r in expected]
        assert plan.regions == len(targets) and plan.bytes_read == sum(r.bytes_read for r in expected)
        assert plan.ranks[1].requests == expected[1].requests  # a rank's own plan, on demand


def test_small_batches_give_the_same_totals():
    chunks = manifest_of(preset("tiny"), ParallelLayout.parse("fsdp=4,tp=2"))
    targets = targets_of(preset("tiny"), ParallelLayout.parse("dp=2,fsdp=3,tp=2"))
    whole, batched = plan_layout(chunks, targets), plan_layout(chunks, targets, batch_targets=7)
    for column in ("rank_bytes_read", "rank_requests", "rank_files", "rank_bytes_needed"):
        assert np.array_equal(getattr(whole, column), getattr(batched, column))


def _error(call) -> str:
    with pytest.raises(CheckpointError) as raised:
        call()
    return str(raised.value)


@pytest.mark.parametrize("damage", ["drop", "shrink", "rank", "missing tensor"])
def test_a_failure_is_plan_ranks_own_verdict_and_message(damage):
    model, target = preset("tiny"), ParallelLayout.parse("fsdp=3,tp=2")
    chunks = manifest_of(model, ParallelLayout.parse("fsdp=2,tp=2"))
    victim = next(i for i, c in enumerate(chunks) if c.name == "layers.1.attention.qkv.weight" and c.kind == "exp_avg")
    if damage == "drop":
        del chunks[victim]
    elif damage == "shrink":
        chunks[victim] = replace(chunks[victim], sizes=(chunks[victim].sizes[0] - 1, *chunks[victim].sizes[1:]))
    elif damage == "rank":
        chunks[victim] = replace(chunks[victim], offsets=(*chunks[victim].offsets, 0), sizes=(*chunks[victim].sizes, 1))
    else:
        chunks = [c for c in chunks if c.name != "layers.1.attention.qkv.weight"]
    targets = targets_of(model, target)
    index, headers = index_chunks(chunks), header_checks(chunks)
    first_failing = None
    for rank in range(target.world_size):  # what the record planner says, rank by rank
        try:
            plan_rank(index, targets.targets_of(rank), rank, headers)
        except CheckpointError as error:
            first_failing = str(error)
            break
    assert first_failing is not None
    assert _error(lambda: plan_layout(chunks, targets, check_sources=False)) == first_failing


def test_target_table_from_records_round_trips():
    model, layout = TIED, ParallelLayout.parse("dp=2,tp=2,pp=2")
    records = layout_targets(model, layout, STATE_KINDS, pipeline_partition(model, layout))
    assert TargetTable.from_lists(records).as_lists() == records


def test_rank_tables_shipped_to_the_driver_gather_into_the_same_manifest():
    chunks = manifest_of(preset("tiny"), ParallelLayout.parse("dp=2,fsdp=2,tp=2"))
    by_file: dict[str, list[Chunk]] = {}
    for chunk in chunks:
        by_file.setdefault(chunk.file, []).append(chunk)
    shipped = [pickle.loads(pickle.dumps(ChunkTable.from_chunks(group), protocol=5)) for group in by_file.values()]
    shipped.append(pickle.loads(pickle.dumps(ChunkTable.from_chunks([]))))  # a rank that wrote nothing
    assert all(not t._made for t in shipped)  # columns travel, records stay behind
    gathered = ChunkTable.concat(shipped)
    assert list(gathered) == chunks
    decoded, _ = decode_manifest(encode_manifest(gathered, {"step": 1}))
    assert list(decoded) == chunks and list(shipped[0]) == by_file[chunks[0].file]
    assert Chunk.from_row(chunks[0]) is chunks[0] and Chunk.from_row(chunks[0].to_row()) == chunks[0]
