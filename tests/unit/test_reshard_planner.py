"""The read planner over random chunkings: exact coverage, and executing the plan on real
safetensors bytes reproduces the target region of the global tensor bit for bit."""
import dataclasses
import itertools
import uuid

import fsspec
import pytest
import torch
from hypothesis import given, settings, strategies as st

from actors.checkpoint.read_executor import fill_from_reads

from actors.checkpoint.shard_writer import Piece, encode_shard
from plans.errors import CheckpointError, ConfigError
from plans.checkpoint.reshard import check_chunks_disjoint_and_complete, plan_reads


@st.composite
def chunked_tensor(draw):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(ndim))
    cuts = []
    for size in shape:
        inner = sorted(draw(st.sets(st.integers(1, size - 1), max_size=3))) if size > 1 else []
        cuts.append([0, *inner, size])
    lo = tuple(draw(st.integers(0, s - 1)) for s in shape)
    hi = tuple(draw(st.integers(l + 1, s)) for l, s in zip(lo, shape))
    files = draw(st.integers(1, 3))
    return shape, cuts, lo, tuple(h - l for l, h in zip(lo, hi)), files


@settings(max_examples=80, deadline=None)
@given(chunked_tensor())
def test_plan_covers_exactly_and_execution_reproduces_the_global_tensor(case):
    shape, cuts, offsets, sizes, files = case
    # Asymmetric values: every element distinct, so swapped or transposed pieces cannot pass.
    global_tensor = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * 1.5 + 0.25
    fs = fsspec.filesystem("memory")
    base = f"/reshard-{uuid.uuid4().hex}"
    pieces_per_file = [[] for _ in range(files)]
    for index, box in enumerate(itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts])):
        region = tuple(slice(a, b) for a, b in box)
        piece = global_tensor[region]
        pieces_per_file[index % files].append(Piece("w", "param", piece, shape, tuple(a for a, _ in box)))
    chunks = []
    for number, pieces in enumerate(pieces_per_file):
        if pieces:
            data, written = encode_shard(pieces, f"f{number}.safetensors")
            fs.pipe_file(f"{base}/f{number}.safetensors", data)
            chunks += written
    check_chunks_disjoint_and_complete(chunks)
    items = plan_reads(chunks, offsets, sizes)
    assert sum(torch.Size(i.sizes).numel() for i in items) == torch.Size(sizes).numel()
    target = torch.full(sizes, float("nan"))
    fill_from_reads(fs, base, items, target, offsets)
    expected = global_tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
    assert torch.equal(target, expected)
    # Bytes read are whole rows of the intersecting chunks, never a whole file.
    for item in items:
        assert item.chunk.byte_start <= item.byte_start < item.byte_end <= item.chunk.byte_end


def test_gaps_and_overlaps_are_reported():
    tensor = torch.arange(12.0).reshape(4, 3)
    _, chunks = encode_shard([Piece("w", "param", tensor[:2], (4, 3), (0, 0))], "a")
    with pytest.raises(CheckpointError, match="cover 6 of the 12"):
        plan_reads(chunks, (0, 0), (4, 3), what="w")
    with pytest.raises(CheckpointError, match="chunks hold 6 elements"):
        check_chunks_disjoint_and_complete(chunks)
    _, overlapping = encode_shard([Piece("w", "param", tensor[:3], (4, 3), (0, 0)),
                                   Piece("w", "param", tensor[1:2], (4, 3), (1, 0))], "b")
    with pytest.raises(CheckpointError, match="overlap|chunks hold"):
        check_chunks_disjoint_and_complete(overlapping)


# ---- whole layouts: random model shapes, random source and target layouts ----------------------

from plans.layout.parallel_layout import ParallelLayout  # noqa: E402
from plans.training.model_spec import ModelConfig, parameter_shapes  # noqa: E402
from plans.checkpoint.layout_plan import plan_layout  # noqa: E402
from plans.checkpoint.writers import predicted_writes  # noqa: E402
from plans.checkpoint.regions import check_layout_fits, layout_target_table, layout_targets  # noqa: E402
from plans.training.model_spec import preset  # noqa: E402


@st.composite
def model_and_layouts(draw):
    n_kv = draw(st.sampled_from([1, 2, 4]))
    heads_per_group = draw(st.integers(1, 2))
    head_dim = draw(st.sampled_from([2, 4]))
    model = ModelConfig(vocab_size=draw(st.sampled_from([8, 12, 16])), dim=n_kv * heads_per_group * head_dim,
                        n_layers=draw(st.integers(1, 4)), n_heads=n_kv * heads_per_group, n_kv_heads=n_kv,
                        ffn_dim=draw(st.sampled_from([4, 8, 12])), tie_embeddings=draw(st.booleans())).validate()

    def layout():
        tp = draw(st.sampled_from([d for d in (1, 2, 4) if n_kv % d == 0 and model.ffn_dim % d == 0 and model.vocab_size % d == 0]))
        pp = draw(st.integers(1, min(2, model.n_layers)))
        vpp = draw(st.sampled_from([v for v in (1, 2) if pp > 1 and pp * v <= model.n_layers] or [1]))
        return ParallelLayout(dp=draw(st.integers(1, 2)), fsdp=draw(st.integers(1, 5)), tp=tp, pp=pp, vpp=vpp)

    return model, layout(), layout(), draw(st.sampled_from([0, 1 << 30]))


@settings(max_examples=40, deadline=None)
@given(model_and_layouts())
def test_any_layout_to_any_layout_covers_exactly_and_reproduces_every_global_tensor(case):
    model, source, target, min_segment_bytes = case
    shapes = parameter_shapes(model)
    kinds = ("param", "exp_avg")
    generator = torch.Generator().manual_seed(0)
    globals_ = {(name, kind): torch.randn(shape, generator=generator) for name, shape in shapes.items() for kind in kinds}
    fs = fsspec.filesystem("memory")
    base = f"/layouts-{uuid.uuid4().hex}"
    chunks = []
    for rank, pieces in enumerate(predicted_writes(model, source, kinds=kinds)):
        if not pieces:
            continue
        written = [Piece(p.region.name, p.kind, globals_[(p.region.name, p.kind)][
            tuple(slice(o, o + s) for o, s in zip(p.region.offsets, p.region.sizes))].clone(),
            p.region.global_shape, p.region.offsets) for p in pieces]
        data, file_chunks = encode_shard(written, f"rank-{rank:05d}.safetensors")
        fs.pipe_file(f"{base}/rank-{rank:05d}.safetensors", data)
        chunks += file_chunks
    targets = layout_targets(model, target, kinds)
    assert layout_target_table(model, target, kinds).as_lists() == targets  # the columns are the records
    plan = plan_layout(chunks, targets, min_segment_bytes)  # proves coverage or raises
    assert plan.bytes_read >= plan.bytes_needed
    # The column-wise totals are plan_rank's, rank by rank.
    assert [(r.bytes_read, len(r.requests), r.files, r.bytes_needed, r.bytes_received) for r in plan.ranks] == list(zip(
        plan.rank_bytes_read.tolist(), plan.rank_requests.tolist(), plan.rank_files.tolist(),
        plan.rank_bytes_needed.tolist(), plan.rank_bytes_received.tolist()))
    from actors.checkpoint.read_executor import Destination, execute_requests

    read_by_rank = [{(t.name, t.kind, t.offsets, t.sizes) for t in r.items} for r in plan.ranks]
    for rank_plan in plan.ranks:
        for received in rank_plan.received:  # read once per dp replica group, by the rank named
            assert (received.name, received.kind, received.offsets, received.sizes) in read_by_rank[received.receive_from]
        buffers = {t: torch.full(t.sizes, float("nan")) for t in rank_plan.items}
        by_item = {item: Destination(buffers[t], t.offsets) for t, items in rank_plan.items.items() for item in items}
        execute_requests(fs, base, rank_plan.requests, by_item)
        for target_piece, buffer in buffers.items():
            expected = globals_[(target_piece.name, target_piece.kind)][
                tuple(slice(o, o + s) for o, s in zip(target_piece.offsets, target_piece.sizes))]
            assert torch.equal(buffer, expected), (target_piece, str(source), str(target))


def test_a_same_layout_load_is_one_request_per_file_of_whole_chunks():
    model = ModelConfig(vocab_size=16, dim=8, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=8).validate()
    layout = ParallelLayout(fsdp=2, tp=2)
    chunks = []
    for rank, pieces in enumerate(predicted_writes(model, layout, kinds=("param",))):
        written = [Piece(p.region.name, p.kind, torch.zeros(p.region.sizes), p.region.global_shape, p.region.offsets) for p in pieces]
        chunks += encode_shard(written, f"rank-{rank}.safetensors")[1]
    plan = plan_layout(chunks, layout_targets(model, layout, ("param",)))
    for rank_plan in plan.ranks:
        assert all(item.whole_chunk for items in rank_plan.items.values() for item in items)  # checksums verified
        assert len(rank_plan.requests) == rank_plan.files  # header + chunks of a file: one coalesced read
    assert plan.bytes_needed == sum(c.byte_end - c.byte_start for c in chunks) + \
        sum(c.byte_end - c.byte_start for c in chunks if c.name.endswith("norm.weight"))  # norms: both tp ranks



@pytest.mark.parametrize("layout", [ParallelLayout(dp=2, tp=2), ParallelLayout(dp=3, fsdp=2), ParallelLayout(dp=2, pp=2),
                                    ParallelLayout(dp=4)], ids=str)
def test_a_same_layout_read_once_load_reads_back_what_each_replica_wrote(layout):
    """Replicas split the reading of copied pieces as they split the writing, so resuming on the
    layout that saved reads each rank's own file (one sequential read per file on S3), the norm
    weights copied over dp and tp included; only pieces copied across pipeline stages (a tied
    embedding) may be read by another rank of the replica group."""
    from plans.checkpoint.replicas import read_once_readers
    from plans.checkpoint.regions import rank_regions

    model = ModelConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48).validate()
    kinds = ("param", "exp_avg", "exp_avg_sq")
    writer = {(p.region.name, p.kind, p.region.offsets): rank
              for rank, pieces in enumerate(predicted_writes(model, layout, kinds=kinds)) for p in pieces}
    checked = 0
    for rank in range(layout.world_size):
        pieces = [(region, kind) for region in rank_regions(model, layout, rank) if region.numel for kind in kinds]
        readers = read_once_readers([r for r, _ in pieces], [r.numel * 4 for r, _ in pieces], layout, layout.coords_of(rank))
        for (region, kind), reader in zip(pieces, readers):
            if "dp" in region.replicated_over and "pp" not in region.replicated_over:
                assert reader == writer[(region.name, kind, region.offsets)], (region.name, kind, rank)
                checked += 1
            elif "dp" not in region.replicated_over:
                assert reader is None  # not handed over: every holder reads it
    assert checked


@pytest.mark.parametrize("changes, layout, message", [
    ({}, ParallelLayout(tp=4), "tp=4: must divide the number of kv heads (2). Fix: use tp in [1, 2]"),
    ({"ffn_dim": 165}, ParallelLayout(tp=2),
     "tp=2: must divide model.ffn_dim (165). Fix: use tp in [1, 3, 5, 11, 15, 33, 55, 165]"),
    ({"vocab_size": 255}, ParallelLayout(tp=2),
     "tp=2: must divide model.vocab_size (255). Fix: use tp in [1, 3, 5, 15, 17, 51, 85, 255]"),
    ({}, ParallelLayout(pp=5), "pp=5: pp*vpp = 5 stages exceed the model's 4 layers. Fix: lower pp or vpp"),
    ({}, ParallelLayout(pp=3, vpp=2), "pp=3: pp*vpp = 6 stages exceed the model's 4 layers. Fix: lower pp or vpp"),
])
def test_a_layout_that_cannot_hold_the_model_is_refused_with_the_divisors_to_use(changes, layout, message):
    model = dataclasses.replace(preset("tiny"), **changes)  # tiny: 2 kv heads, ffn 160, vocab 256, 4 layers
    with pytest.raises(ConfigError) as refused:
        check_layout_fits(model, layout)
    assert str(refused.value) == message


def test_a_layout_that_holds_the_model_passes_the_fit_check():
    for layout in (ParallelLayout(tp=2, pp=2, vpp=2), ParallelLayout(pp=4), ParallelLayout(dp=8)):
        check_layout_fits(preset("tiny"), layout)  # 4 stages of 4 layers: one layer each
