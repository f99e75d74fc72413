"""The read planner over random chunkings: exact coverage, and executing the plan on real
safetensors bytes reproduces the target region of the global tensor bit for bit."""
import dataclasses
import itertools
import math
import uuid

import fsspec
import pytest
import torch
from hypothesis import given, settings, strategies as st

from rayshard.actors.checkpoint.read_executor import fill_from_reads

from rayshard.actors.checkpoint.shard_writer import Piece, encode_shard
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.plans.checkpoint.reshard import check_chunks_disjoint_and_complete, plan_reads


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

from rayshard.plans.layout.parallel_layout import ParallelLayout  # noqa: E402
from rayshard.plans.training.model_spec import ModelConfig, parameter_shapes  # noqa: E402
from rayshard.plans.checkpoint.layout_plan import plan_layout  # noqa: E402
from rayshard.plans.checkpoint.writers import predicted_writes  # noqa: E402
from rayshard.plans.checkpoint.regions import check_layout_fits, layout_target_table, layout_targets  # noqa: E402
from rayshard.plans.training.model_spec import preset  # noqa: E402


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
    from rayshard.actors.checkpoint.read_executor import Destination, execute_requests

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
    from rayshard.plans.checkpoint.replicas import read_once_readers
    from rayshard.plans.checkpoint.regions import rank_regions

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
     "tp=2: must divide model.ffn_dim (165). Fix: use tp in [1]"),  # also dividing the 2 kv heads
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
    check_layout_fits(preset("tiny", vocab_size=255), ParallelLayout(tp=2))  # an uneven vocabulary (decision 118)


# ---- regions worked by hand: a user model's records, tp = 1 / dp = 1, pipeline cuts ------------

from rayshard.plans.checkpoint.reshard import Target as _Target  # noqa: E402
from rayshard.plans.checkpoint.regions import (Region, pipeline_partition, rank_regions, rank_tensor_names,  # noqa: E402
                                      tensor_region)
from rayshard.plans.layout.parallel_layout import RankCoords  # noqa: E402
from rayshard.plans.training.model_plan import ModelPlan, UserModel  # noqa: E402
from rayshard.plans.training.tp_plan import COLWISE, ROWWISE, VOCAB_EMBEDDING  # noqa: E402

# A user's model as its checkpoint records it (no factory is imported): vocabulary 10, width 4,
# two blocks of a 6-wide MLP; its names are not the reference model's, and its attention fields
# (1 kv head, ffn 3) would refuse tp = 2 if the built-in rules were applied to it.
_USER_PLAN = ModelPlan(tp_styles=(("emb", VOCAB_EMBEDDING), ("blocks.*.up", COLWISE), ("blocks.*.down", ROWWISE)),
                       blocks="blocks", first_stage=("emb",), last_stage=("norm",), hidden_size=4, vocab_size=10)
_USER_PARAMETERS = (("emb.weight", (10, 4), 0), ("blocks.0.up.weight", (6, 4), 0), ("blocks.0.up.bias", (6,), 0),
                    ("blocks.0.down.weight", (4, 6), 1), ("blocks.1.up.weight", (6, 4), 0), ("blocks.1.up.bias", (6,), 0),
                    ("blocks.1.down.weight", (4, 6), 1), ("norm.weight", (4,), -1))


def _user_model(parameters=_USER_PARAMETERS, n_layers=2):
    return ModelConfig(family="user", vocab_size=10, dim=4, n_layers=n_layers, n_heads=1, n_kv_heads=1, ffn_dim=3,
                       user=UserModel("pkg.module:make", _USER_PLAN, parameters))


def test_a_user_model_is_fitted_by_its_parameters_splits_not_by_the_reference_fields():
    user = _user_model()
    check_layout_fits(user, ParallelLayout(tp=2, fsdp=3))  # 1 kv head and ffn 3 would refuse tp = 2
    check_layout_fits(user, ParallelLayout(pp=2))
    check_layout_fits(user, ParallelLayout(tp=3))  # the vocabulary of 10 unevenly (decision 118), up's 6 rows evenly
    with pytest.raises(ConfigError) as refused:
        check_layout_fits(user, ParallelLayout(tp=4))
    assert str(refused.value) == ("tp=4: cannot split parameter blocks.0.up.weight of shape [6, 4] along dim 0. "
                                  "Fix: use tp in [1, 2, 3, 6], or leave its module out of the plan's tp_styles")
    with pytest.raises(ConfigError) as refused:
        check_layout_fits(user, ParallelLayout(pp=3))
    assert str(refused.value) == "pp=3: pp*vpp = 3 stages exceed the model's 2 layers. Fix: lower pp or vpp"
    with pytest.raises(ConfigError) as refused:
        check_layout_fits(user, ParallelLayout(fsdp=2, ep=2))
    assert str(refused.value).startswith("ep=2: expert parallelism needs a mixture-of-experts model.")


def test_expert_parallelism_on_a_dense_reference_model_is_refused_by_the_fit_check():
    with pytest.raises(ConfigError) as refused:
        check_layout_fits(preset("tiny"), ParallelLayout(fsdp=2, ep=2))
    assert str(refused.value) == ("ep=2: expert parallelism needs a mixture-of-experts model. "
                                  "Fix: set --ep 1, or train an MoE model (--model moe-tiny)")


@pytest.mark.parametrize("name, shape, layout, coords, styles, expected", [
    # no tp, no dp: the whole tensor, copied nowhere
    ("layers.0.attention.wo.weight", (8, 12), ParallelLayout(), RankCoords(0, 0, 0, 0), None,
     ((0, 0), (8, 12), ())),
    # rowwise (dim 1, blocks of 6), then fsdp 3 cuts the 8 rows 3/3/2: the last chunk is rows 6..7
    ("layers.0.attention.wo.weight", (8, 12), ParallelLayout(tp=2, fsdp=3), RankCoords(0, 0, 2, 1), None,
     ((6, 6), (2, 6), ())),
    # colwise rows 8..15 of tp rank 1, fsdp 2 cuts them in 4 + 4: the second is rows 12..15 (strided)
    ("layers.0.attention.qkv.weight", (16, 8), ParallelLayout(tp=2, fsdp=2), RankCoords(0, 0, 1, 1), None,
     ((12, 0), (4, 8), ())),
    # fsdp alone (dp = 1): rows 12..23 of 24
    ("layers.0.feed_forward.gate_up.weight", (24, 8), ParallelLayout(fsdp=2), RankCoords(0, 0, 1, 0), None,
     ((12, 0), (12, 8), ())),
    # dp alone: whole, copied along dp
    ("layers.0.feed_forward.down.weight", (8, 12), ParallelLayout(dp=2), RankCoords(0, 1, 0, 0), None,
     ((0, 0), (8, 12), ("dp",))),
    # a norm under dp and tp: whole on every rank, copied along both
    ("norm.weight", (8,), ParallelLayout(dp=2, tp=2), RankCoords(0, 1, 0, 1), None, ((0,), (8,), ("dp", "tp"))),
    # a norm under tp alone: copied along tp only
    ("norm.weight", (8,), ParallelLayout(tp=2), RankCoords(0, 0, 0, 1), None, ((0,), (8,), ("tp",))),
    # a 0-d tensor is never cut by fsdp
    ("scale", (), ParallelLayout(fsdp=2), RankCoords(0, 0, 1, 0), None, ((), (), ())),
    # a user's styles: its embedding split by rows into 5 + 5 ...
    ("emb.weight", (10, 4), ParallelLayout(tp=2), RankCoords(0, 0, 0, 1), _USER_PLAN.tp_styles, ((5, 0), (5, 4), ())),
    # ... which the reference styles (styles None) do not know: whole, copied along tp
    ("emb.weight", (10, 4), ParallelLayout(tp=2), RankCoords(0, 0, 0, 1), None, ((0, 0), (10, 4), ("tp",))),
    # tp = 1 never consults the styles: a rowwise module's 1-D weight (no dim 1 to split) is cut by fsdp alone
    ("blocks.0.down.weight", (4,), ParallelLayout(fsdp=2), RankCoords(0, 0, 1, 0), _USER_PLAN.tp_styles, ((2,), (2,), ())),
    # the reference model's embedding is split without styles given
    ("tok_embeddings.weight", (16, 8), ParallelLayout(tp=4), RankCoords(0, 0, 0, 3), None, ((12, 0), (4, 8), ())),
], ids=lambda value: str(value) if isinstance(value, ParallelLayout) else None)
def test_tensor_region_worked_by_hand(name, shape, layout, coords, styles, expected):
    region = tensor_region(name, shape, layout, coords, styles)
    assert (region.offsets, region.sizes, region.replicated_over) == expected
    assert (region.name, region.global_shape, region.tied_copy) == (name, shape, False)


# A user model on fsdp = 3 x tp = 2, by hand: tp splits emb (rows 5 + 5), up and its bias (rows
# 3 + 3) and down (columns 3 + 3); fsdp then cuts dim 0 of each tp-local piece with torch.chunk's
# sizes: 5 rows -> 2, 2, 1; 3 rows -> 1, 1, 1; down's 4 rows -> 2, 2, 0; the norm (4, copied on
# both tp ranks) -> 2, 2, 0.  (name, offsets, sizes) per rank; rank = fsdp * 2 + tp.
_USER_FSDP3_TP2 = [
    [("emb.weight", (0, 0), (2, 4)), ("blocks.0.up.weight", (0, 0), (1, 4)), ("blocks.0.up.bias", (0,), (1,)),
     ("blocks.0.down.weight", (0, 0), (2, 3)), ("blocks.1.up.weight", (0, 0), (1, 4)), ("blocks.1.up.bias", (0,), (1,)),
     ("blocks.1.down.weight", (0, 0), (2, 3)), ("norm.weight", (0,), (2,))],
    [("emb.weight", (5, 0), (2, 4)), ("blocks.0.up.weight", (3, 0), (1, 4)), ("blocks.0.up.bias", (3,), (1,)),
     ("blocks.0.down.weight", (0, 3), (2, 3)), ("blocks.1.up.weight", (3, 0), (1, 4)), ("blocks.1.up.bias", (3,), (1,)),
     ("blocks.1.down.weight", (0, 3), (2, 3)), ("norm.weight", (0,), (2,))],
    [("emb.weight", (2, 0), (2, 4)), ("blocks.0.up.weight", (1, 0), (1, 4)), ("blocks.0.up.bias", (1,), (1,)),
     ("blocks.0.down.weight", (2, 0), (2, 3)), ("blocks.1.up.weight", (1, 0), (1, 4)), ("blocks.1.up.bias", (1,), (1,)),
     ("blocks.1.down.weight", (2, 0), (2, 3)), ("norm.weight", (2,), (2,))],
    [("emb.weight", (7, 0), (2, 4)), ("blocks.0.up.weight", (4, 0), (1, 4)), ("blocks.0.up.bias", (4,), (1,)),
     ("blocks.0.down.weight", (2, 3), (2, 3)), ("blocks.1.up.weight", (4, 0), (1, 4)), ("blocks.1.up.bias", (4,), (1,)),
     ("blocks.1.down.weight", (2, 3), (2, 3)), ("norm.weight", (2,), (2,))],
    [("emb.weight", (4, 0), (1, 4)), ("blocks.0.up.weight", (2, 0), (1, 4)), ("blocks.0.up.bias", (2,), (1,)),
     ("blocks.0.down.weight", (4, 0), (0, 3)), ("blocks.1.up.weight", (2, 0), (1, 4)), ("blocks.1.up.bias", (2,), (1,)),
     ("blocks.1.down.weight", (4, 0), (0, 3)), ("norm.weight", (4,), (0,))],
    [("emb.weight", (9, 0), (1, 4)), ("blocks.0.up.weight", (5, 0), (1, 4)), ("blocks.0.up.bias", (5,), (1,)),
     ("blocks.0.down.weight", (4, 3), (0, 3)), ("blocks.1.up.weight", (5, 0), (1, 4)), ("blocks.1.up.bias", (5,), (1,)),
     ("blocks.1.down.weight", (4, 3), (0, 3)), ("norm.weight", (4,), (0,))],
]


def test_a_user_models_regions_and_targets_on_fsdp_and_tp_worked_by_hand():
    user, layout = _user_model(), ParallelLayout(fsdp=3, tp=2)
    shapes = dict((name, shape) for name, shape, _ in _USER_PARAMETERS)
    for rank, expected in enumerate(_USER_FSDP3_TP2):
        assert rank_regions(user, layout, rank) == [
            Region(name, shapes[name], offsets, sizes, ("tp",) if name == "norm.weight" else ()) for name, offsets, sizes in expected]
    # Targets: empty regions (the third fsdp chunk of down and of the norm) are left out, kinds listed per region.
    kinds = ("param", "exp_avg")
    expected_targets = [[_Target(name, kind, offsets, sizes, None, 2) for name, offsets, sizes in expected if 0 not in sizes
                         for kind in kinds] for expected in _USER_FSDP3_TP2]
    assert [len(targets) for targets in expected_targets] == [16, 16, 16, 16, 10, 10]
    assert layout_targets(user, layout, kinds, itemsize=2) == expected_targets
    table = layout_target_table(user, layout, kinds, itemsize=2)
    assert table.as_lists() == expected_targets
    assert table.itemsize.tolist() == [2] * 84 and table.width == 2
    # The column types `TargetTable` documents (int32 dictionary codes, int64 elsewhere).
    assert [str(column.dtype) for column in (table.rank, table.name_code, table.kind_code, table.ndim, table.receive_from,
                                             table.itemsize, table.offsets, table.sizes)] == \
        ["int64", "int32", "int32", "int64", "int64", "int64", "int64", "int64"]


def test_a_stage_that_holds_no_parameter_is_skipped_and_the_next_stage_still_listed():
    """A user model whose block 0 has no parameters (and no first-stage module): on pp = 2 the
    first stage holds nothing, the second block 1 and the norm."""
    user = _user_model(parameters=(("blocks.1.up.weight", (6, 4), 0), ("norm.weight", (4,), -1)))
    layout = ParallelLayout(pp=2)
    partition = pipeline_partition(user, layout)
    assert rank_tensor_names(user, layout, 0, partition) == []
    assert rank_tensor_names(user, layout, 1, partition) == [("blocks.1.up.weight", False), ("norm.weight", False)]
    expected = [[], [_Target("blocks.1.up.weight", "param", (0, 0), (6, 4)), _Target("norm.weight", "param", (0,), (4,))]]
    assert layout_targets(user, layout, ("param",)) == expected
    assert layout_target_table(user, layout, ("param",)).as_lists() == expected


def test_the_columns_and_the_records_agree_even_where_tp_does_not_divide_a_split_dim():
    """tp = 3 on the user model's 8-wide up projections: the fit check refuses it, but both
    functions cut it alike, as DTensor's Shard does (torch.chunk's blocks of 3, 3 and 2 rows, as an
    uneven vocabulary is cut: decision 118)."""
    user = _user_model(parameters=(("blocks.0.up.weight", (8, 4), 0), ("blocks.1.up.weight", (6, 4), 0)))
    layout = ParallelLayout(tp=3)
    with pytest.raises(ConfigError, match="cannot split parameter blocks.0.up.weight of shape \\[8, 4\\] along dim 0"):
        check_layout_fits(user, layout)
    records = layout_targets(user, layout, ("param",))
    assert [[(t.name, t.offsets, t.sizes) for t in rank] for rank in records] == [
        [("blocks.0.up.weight", (3 * tp, 0), (3 if tp < 2 else 2, 4)), ("blocks.1.up.weight", (2 * tp, 0), (2, 4))]
        for tp in range(3)]
    assert layout_target_table(user, layout, ("param",)).as_lists() == records


def test_a_user_plan_that_only_fits_tp_1_still_has_regions_at_tp_1():
    """A rowwise style on a module whose weight is 1-D: tp = 2 cannot split it (refused, naming it),
    but at tp = 1 the styles play no part and fsdp = 2 cuts the 4 entries 2 + 2."""
    user = _user_model(parameters=(("blocks.0.down.weight", (4,), 1), ("blocks.1.down.weight", (3, 2), 1)))
    check_layout_fits(user, ParallelLayout(fsdp=2))
    with pytest.raises(ConfigError) as refused:
        check_layout_fits(user, ParallelLayout(tp=2))
    assert str(refused.value) == ("tp=2: cannot split parameter blocks.0.down.weight of shape [4] along dim 1. "
                                  "Fix: use tp in [1], or leave its module out of the plan's tp_styles")
    layout = ParallelLayout(fsdp=2)
    expected = [[_Target("blocks.0.down.weight", "param", (0,), (2,)), _Target("blocks.1.down.weight", "param", (0, 0), (2, 2))],
                [_Target("blocks.0.down.weight", "param", (2,), (2,)), _Target("blocks.1.down.weight", "param", (2, 0), (1, 2))]]
    assert layout_targets(user, layout, ("param",)) == expected
    assert layout_target_table(user, layout, ("param",)).as_lists() == expected


def test_a_dp_pair_reads_each_piece_once_and_splits_the_bytes_evenly():
    """dp = 2 of the user model: every piece copied along dp; one replica reads it, the other
    receives it. Element counts 40, 24 x 4, 6 x 2, 4 split largest first: 76 and 76."""
    user, layout = _user_model(), ParallelLayout(dp=2)
    for targets in (layout_targets(user, layout, ("param",), itemsize=2),
                    layout_target_table(user, layout, ("param",), itemsize=2).as_lists()):
        assert [[(t.name, t.offsets, t.sizes) for t in rank] for rank in targets] == \
            [[(name, (0,) * len(shape), shape) for name, shape, _ in _USER_PARAMETERS]] * 2
        read_by = []
        for mine, other in ((targets[0], targets[1]), (targets[1], targets[0])):
            for a, b in zip(mine, other):
                assert {a.receive_from, b.receive_from} in ({None, 0}, {None, 1})  # exactly one reads it
        for rank, peer in ((0, 1), (1, 0)):
            assert all(t.receive_from in (None, peer) for t in targets[rank])
            read_by.append(sum(math.prod(t.sizes) * t.itemsize for t in targets[rank] if t.receive_from is None))
        assert read_by == [152, 152]
    # Without read-once every replica reads everything itself.
    assert all(t.receive_from is None for rank in layout_targets(user, layout, ("param",), read_once=False) for t in rank)
    table = layout_target_table(user, layout, ("param",), read_once=False)
    assert table.receive_from.tolist() == [-1] * 16


def test_a_user_model_on_two_stages_holds_its_blocks_and_first_and_last_parts_by_hand():
    user, layout = _user_model(), ParallelLayout(pp=2)
    partition = pipeline_partition(user, layout)
    first = ["emb.weight", "blocks.0.up.weight", "blocks.0.up.bias", "blocks.0.down.weight"]
    last = ["blocks.1.up.weight", "blocks.1.up.bias", "blocks.1.down.weight", "norm.weight"]
    assert rank_tensor_names(user, layout, 0, partition) == [(name, False) for name in first]
    assert rank_tensor_names(user, layout, 1, partition) == [(name, False) for name in last]
    # Without a partition, or with pp = 1, a rank holds every parameter.
    every = [(name, False) for name, _, _ in _USER_PARAMETERS]
    assert rank_tensor_names(user, layout, 1, None) == every
    assert rank_tensor_names(user, ParallelLayout(), 0, partition) == every
    # rank_regions finds the trainer's partition itself when given none.
    shapes = dict((name, shape) for name, shape, _ in _USER_PARAMETERS)
    for rank, names in enumerate((first, last)):
        expected = [Region(name, shapes[name], (0,) * len(shapes[name]), shapes[name], ()) for name in names]
        assert rank_regions(user, layout, rank) == expected
        assert rank_regions(user, layout, rank, partition) == expected
        assert [[t.name for t in targets] for targets in layout_targets(user, layout, ("param",))] == [first, last]
        assert [[t.name for t in targets] for targets in layout_target_table(user, layout, ("param",)).as_lists()] == [first, last]
    assert rank_regions(user, ParallelLayout(), 0) == [Region(n, s, (0,) * len(s), s, ()) for n, s in shapes.items()]


_LAYER_PARTS = ("attention_norm.weight", "attention.qkv.weight", "attention.wo.weight", "ffn_norm.weight",
                "feed_forward.gate_up.weight", "feed_forward.down.weight")
_TIED = ModelConfig(vocab_size=16, dim=8, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=12, tie_embeddings=True).validate()


def _layers(*indices):
    return [f"layers.{i}.{part}" for i in indices for part in _LAYER_PARTS]


def test_a_given_stage_cut_decides_each_ranks_tensors_and_the_tied_copy_goes_last():
    """Layers cut 1 + 3 (not the balanced 2 + 2): the last stage also holds a copy of the tied
    embedding, listed after its layers and before the final norm; tp = 2 splits it as on the first."""
    layout = ParallelLayout(tp=2, pp=2)
    partition = pipeline_partition(_TIED, layout, stage_layout=[1, 3])
    assert rank_tensor_names(_TIED, layout, 0, partition) == [(n, False) for n in ["tok_embeddings.weight", *_layers(0)]]
    assert rank_tensor_names(_TIED, layout, 1, partition) == \
        [(n, False) for n in _layers(1, 2, 3)] + [("tok_embeddings.weight", True), ("norm.weight", False)]
    # global rank 3 = pp 1, tp 1: the tied copy is rows 8..15, flagged; rank 1 (pp 0, tp 1) holds the same rows unflagged.
    last = rank_regions(_TIED, layout, 3, partition)
    assert [r.name for r in last] == _layers(1, 2, 3) + ["tok_embeddings.weight", "norm.weight"]
    assert last[-2] == Region("tok_embeddings.weight", (16, 8), (8, 0), (8, 8), (), tied_copy=True)
    assert rank_regions(_TIED, layout, 1, partition)[0] == Region("tok_embeddings.weight", (16, 8), (8, 0), (8, 8), ())
    assert [t.name for t in layout_targets(_TIED, layout, ("param",), partition)[3]] == [r.name for r in last]
    assert layout_target_table(_TIED, layout, ("param",), partition).as_lists() == layout_targets(_TIED, layout, ("param",), partition)
    # The balanced cut, found when no partition is given, puts two layers on each stage.
    assert [r.name for r in rank_regions(_TIED, layout, 2)] == _layers(2, 3) + ["tok_embeddings.weight", "norm.weight"]
    # pp = 1: one rank holds the embedding once, never a tied copy.
    assert [(r.name, r.tied_copy) for r in rank_regions(_TIED, ParallelLayout(), 0)] == \
        [("tok_embeddings.weight", False)] + [(n, False) for n in _layers(0, 1, 2, 3)] + [("norm.weight", False)]


def test_a_v_cut_puts_the_first_and_last_stage_on_one_rank_with_no_tied_copy():
    layout = ParallelLayout(pp=2, vpp=2)  # ZB-V: stages 0 and 3 on rank 0, 1 and 2 on rank 1
    partition = pipeline_partition(_TIED, layout, "zbv")
    assert rank_tensor_names(_TIED, layout, 0, partition) == \
        [(n, False) for n in ["tok_embeddings.weight", *_layers(0, 3), "norm.weight"]]
    assert rank_tensor_names(_TIED, layout, 1, partition) == [(n, False) for n in _layers(1, 2)]
    untied = dataclasses.replace(_TIED, tie_embeddings=False)
    names = [n for n, _ in rank_tensor_names(untied, ParallelLayout(pp=2), 1, pipeline_partition(untied, ParallelLayout(pp=2)))]
    assert names == _layers(2, 3) + ["norm.weight", "output.weight"]


def test_a_model_without_parameters_gives_an_empty_table_with_the_documented_column_types():
    table = layout_target_table(_user_model(parameters=()), ParallelLayout(dp=2, tp=2), ("param", "exp_avg"))
    assert (len(table), table.world_size, table.names, table.kinds) == (0, 4, [], ["param", "exp_avg"])
    assert [str(column.dtype) for column in (table.rank, table.name_code, table.kind_code, table.ndim, table.receive_from,
                                             table.itemsize, table.offsets, table.sizes)] == \
        ["int64", "int32", "int32", "int64", "int64", "int64", "int64", "int64"]
    assert table.offsets.shape == table.sizes.shape == (0, 1)
    assert table.as_lists() == [[], [], [], []]


# ---- small cases worked by hand: byte ranges, coalescing, a rank's plan ---------------------------

from rayshard.plans.checkpoint.chunks import Chunk  # noqa: E402
from rayshard.plans.checkpoint.reshard import (HeaderCheck, RankReadPlan, ReadItem, Request, Target, TensorChunks,  # noqa: E402
                                      _items_for_overlap, coalesce, header_checks, index_chunks, plan_rank)


def _c(shape, offsets, sizes, start, name="w", file="f", kind="param", dtype="float32"):
    nbytes = 4 * _n(sizes)
    return Chunk(name, kind, dtype, shape, offsets, sizes, file, start, start + nbytes, f"crc32:{start:08x}", "")


def _n(sizes):
    count = 1
    for size in sizes:
        count *= size
    return count


def _spans(items):
    return [(i.byte_start, i.byte_end, i.held_offsets, i.held_sizes, i.offsets, i.sizes) for i in items]


def test_a_column_block_is_read_row_by_row_or_as_whole_rows():
    # A 4 x 6 float32 chunk at byte 100: 24 bytes a row. The region rows 1-2, columns 2-4: 12 bytes a row.
    chunk = _c((4, 6), (0, 0), (4, 6), 100)
    assert _spans(_items_for_overlap(chunk, (1, 2), (2, 3), 12)) == [
        (132, 144, (1, 2), (1, 3), (1, 2), (1, 3)), (156, 168, (2, 2), (1, 3), (2, 2), (1, 3))]
    # Segments shorter than min_segment_bytes: whole rows 1-2 instead, bytes 124-172.
    assert _spans(_items_for_overlap(chunk, (1, 2), (2, 3), 13)) == [(124, 172, (1, 0), (2, 6), (1, 2), (2, 3))]
    # Full rows: one range, whatever min_segment_bytes.
    assert _spans(_items_for_overlap(chunk, (1, 0), (2, 6), 1)) == [(124, 172, (1, 0), (2, 6), (1, 0), (2, 6))]


def test_byte_ranges_of_a_chunk_that_starts_inside_the_tensor():
    # Rows 2-3, columns 3-5 of a 4 x 6 tensor, at byte 40: 12 bytes a row.
    chunk = _c((4, 6), (2, 3), (2, 3), 40)
    assert _spans(_items_for_overlap(chunk, (3, 4), (1, 2), 8)) == [(56, 64, (3, 4), (1, 2), (3, 4), (1, 2))]
    assert _spans(_items_for_overlap(chunk, (3, 4), (1, 2), 9)) == [(52, 64, (3, 3), (1, 3), (3, 4), (1, 2))]
    assert _spans(_items_for_overlap(chunk, (2, 3), (2, 3), 1)) == [(40, 64, (2, 3), (2, 3), (2, 3), (2, 3))]


def test_byte_ranges_of_a_three_dimensional_chunk():
    # 3 x 4 x 2 float32 at byte 0: a dim-0 row is 32 bytes, a dim-1 row 8.
    chunk = _c((3, 4, 2), (0, 0, 0), (3, 4, 2), 0)
    # dims 1 partly, 2 whole: one range per dim-0 row, columns 1-2 = bytes 8-24 of each row.
    assert _spans(_items_for_overlap(chunk, (1, 1, 0), (2, 2, 2), 16)) == [
        (40, 56, (1, 1, 0), (1, 2, 2), (1, 1, 0), (1, 2, 2)), (72, 88, (2, 1, 0), (1, 2, 2), (2, 1, 0), (1, 2, 2))]
    assert _spans(_items_for_overlap(chunk, (1, 1, 0), (2, 2, 2), 17)) == [
        (32, 96, (1, 0, 0), (2, 4, 2), (1, 1, 0), (2, 2, 2))]
    # dim 2 partly: whole dim-0 rows, whatever min_segment_bytes.
    assert _spans(_items_for_overlap(chunk, (1, 1, 1), (1, 2, 1), 0)) == [(32, 64, (1, 0, 0), (1, 4, 2), (1, 1, 1), (1, 2, 1))]


def test_a_scalar_is_read_whole():
    chunk = _c((), (), (), 8)
    assert _spans(_items_for_overlap(chunk, (), (), 0)) == [(8, 12, (), (), (), ())]
    assert _spans(plan_reads([chunk], (), ())) == [(8, 12, (), (), (), ())]


def test_read_item_sizes():
    chunk = _c((4, 6), (0, 0), (4, 6), 100, dtype="bfloat16")  # byte_end as float32: only the ranges matter here
    item = ReadItem(chunk, 124, 172, (1, 0), (2, 6), (1, 2), (2, 3))
    assert (item.file, item.nbytes, item.needed_bytes, item.whole_chunk) == ("f", 48, 12, False)
    whole = ReadItem(chunk, 100, 196, (0, 0), (4, 6), (0, 0), (4, 6))
    assert whole.whole_chunk and not ReadItem(chunk, 100, 195, (0, 0), (4, 6), (0, 0), (4, 6)).whole_chunk
    assert not ReadItem(chunk, 101, 196, (0, 0), (4, 6), (0, 0), (4, 6)).whole_chunk


def test_plan_reads_finds_exactly_the_overlapping_chunks():
    # Rows of 2 columns, cut at 0, 2, 5, 6 of 8: chunks 2, 3, 1 and 2 rows tall.
    chunks = [_c((8, 2), (0, 0), (2, 2), 0), _c((8, 2), (2, 0), (3, 2), 16), _c((8, 2), (5, 0), (1, 2), 40),
              _c((8, 2), (6, 0), (2, 2), 48)]
    for index in (chunks, TensorChunks(chunks[::-1]), index_chunks(chunks[::-1])[("w", "param")]):
        assert _spans(plan_reads(index, (4, 0), (3, 2))) == [(32, 40, (4, 0), (1, 2), (4, 0), (1, 2)),
                                                              (40, 48, (5, 0), (1, 2), (5, 0), (1, 2)),
                                                              (48, 56, (6, 0), (1, 2), (6, 0), (1, 2))]
        assert _spans(plan_reads(index, (1, 1), (1, 1), min_segment_bytes=0)) == [(12, 16, (1, 1), (1, 1), (1, 1), (1, 1))]
        assert _spans(plan_reads(index, (7, 0), (1, 2))) == [(56, 64, (7, 0), (1, 2), (7, 0), (1, 2))]
        assert _spans(plan_reads(index, (0, 0), (1, 2))) == [(0, 8, (0, 0), (1, 2), (0, 0), (1, 2))]
        assert plan_reads(index, (3, 0), (0, 2)) == []  # an empty region reads nothing
    # The candidates: chunks starting after offset - tallest (3 rows) and before the region's end.
    for index in (TensorChunks(chunks[::-1]), index_chunks(chunks[::-1])[("w", "param")]):
        assert [c.offsets for c in index.overlapping((5, 0), (2, 2))] == [(5, 0), (6, 0)]
        assert [c.offsets for c in index.overlapping((4, 0), (1, 2))] == [(2, 0)]
        assert [c.offsets for c in index.overlapping((3, 0), (3, 2))] == [(2, 0), (5, 0)]


def test_plan_reads_refuses_a_stored_rank_that_differs():
    with pytest.raises(CheckpointError) as raised:
        plan_reads([_c((8,), (0,), (8,), 0)], (0, 0), (2, 2), "w (param)")
    assert str(raised.value) == "w (param): stored rank 1 differs from target rank 2"


def test_plan_reads_names_what_it_covers():
    with pytest.raises(CheckpointError) as raised:
        plan_reads([_c((8, 2), (0, 0), (2, 2), 0), _c((8, 2), (4, 0), (4, 2), 16)], (1, 0), (4, 2), "w (param)")
    assert str(raised.value) == ("w (param): the checkpoint's chunks cover 4 of the 8 elements needed for region "
                                 "offsets=(1, 0) sizes=(4, 2); the checkpoint is incomplete or its manifest is damaged")


def _part(file, start, end):
    return HeaderCheck(file, start, end, "crc32:0")


def test_coalesce_merges_touching_and_overlapping_ranges_of_a_file():
    parts = [_part("b", 0, 10), _part("a", 20, 30), _part("a", 0, 10), _part("a", 10, 15), _part("a", 12, 14),
             _part("a", 16, 20)]
    requests = coalesce(parts)
    assert [(r.file, r.byte_start, r.byte_end, [(p.byte_start, p.byte_end) for p in r.parts]) for r in requests] == [
        ("a", 0, 15, [(0, 10), (10, 15), (12, 14)]), ("a", 16, 30, [(16, 20), (20, 30)]), ("b", 0, 10, [(0, 10)])]
    assert [r.nbytes for r in requests] == [15, 14, 10]
    assert coalesce([]) == []


def test_coalesce_never_grows_a_request_past_the_limit():
    parts = [_part("a", 0, 10), _part("a", 10, 20), _part("a", 20, 25), _part("a", 22, 30)]
    assert [(r.byte_start, r.byte_end) for r in coalesce(parts, 20)] == [(0, 20), (20, 30)]
    assert [(r.byte_start, r.byte_end) for r in coalesce(parts, 19)] == [(0, 10), (10, 25), (22, 30)]
    assert [(r.byte_start, r.byte_end) for r in coalesce(parts, 25)] == [(0, 25), (22, 30)]
    assert [(r.byte_start, r.byte_end) for r in coalesce(parts, 30)] == [(0, 30)]


def test_a_rank_plan_reads_its_targets_and_receives_the_rest():
    # Two files: w rows 0-1 in f (whole), rows 2-3 in g; v (4 elements) in g after w's rows.
    chunks = [_c((4, 2), (0, 0), (2, 2), 10, file="f"), _c((4, 2), (2, 0), (2, 2), 10, file="g"),
              _c((4,), (0,), (4,), 26, name="v", file="g")]
    headers = {"f": HeaderCheck("f", 0, 10, "crc32:f"), "g": HeaderCheck("g", 0, 10, "crc32:g")}
    index = index_chunks(chunks)
    targets = [Target("w", "param", (1, 0), (2, 2)), Target("v", "param", (0,), (4,)),
               Target("w", "param", (0, 0), (1, 2), receive_from=3, itemsize=2)]
    cache = {}
    plan = plan_rank(index, targets, rank=5, headers=headers, cache=cache)
    assert plan.rank == 5 and plan.received == [targets[2]] and list(plan.items) == targets[:2]
    # w's rows 1 (f, bytes 18-26) and 2 (g, bytes 10-18) are parts of chunks: both files' headers are
    # checked; g's header (0-10) touches row 2 and joins its request; v (26-42) is a whole chunk.
    assert [(r.file, r.byte_start, r.byte_end, len(r.parts)) for r in plan.requests] == [
        ("f", 0, 10, 1), ("f", 18, 26, 1), ("g", 0, 18, 2), ("g", 26, 42, 1)]
    assert (plan.bytes_read, plan.bytes_needed, plan.bytes_received, plan.files) == (52, 32, 4, 2)
    # Without headers, or with v alone (a whole chunk), no header is read.
    assert [(r.file, r.byte_start, r.byte_end) for r in plan_rank(index, targets[1:2], headers=headers).requests] == [
        ("g", 26, 42)]
    assert [(r.file, r.byte_start, r.byte_end) for r in plan_rank(index, targets[:1]).requests] == [
        ("f", 18, 26), ("g", 10, 18)]
    assert set(cache) == {("w", "param", (1, 0), (2, 2)), ("v", "param", (0,), (4,))}
    again = plan_rank(index, targets[:1], cache={("w", "param", (1, 0), (2, 2)): []})
    assert again.items == {targets[0]: []} and again.requests == []  # the cached answer, not planned again
    with pytest.raises(CheckpointError) as raised:
        plan_rank(index, [Target("u", "exp_avg", (0,), (1,))])
    assert str(raised.value) == "u (exp_avg): not in the checkpoint"


def test_a_region_no_chunk_reaches_still_names_the_missing_experts():
    # Expert 0 only (one 1-row chunk of an 8-expert tensor); the region wants experts 4-7.
    name = "layers.0.feed_forward.experts.w2.weight"
    only = _c((8, 4, 2), (0, 0, 0), (1, 4, 2), 0, name=name)
    for index in ([only], index_chunks([only])[(name, "param")]):
        with pytest.raises(CheckpointError) as raised:
            plan_reads(index, (4, 0, 0), (4, 4, 2), "w2")
        assert str(raised.value) == ("w2: the checkpoint's chunks cover 0 of the 32 elements needed for region "
                                     "offsets=(4, 0, 0) sizes=(4, 4, 2) (experts missing or incomplete: expert 4-7); "
                                     "the checkpoint is incomplete or its manifest is damaged")
    with pytest.raises(CheckpointError) as raised:  # no chunk at all: no note
        plan_reads([], (0,), (4,), "w")
    assert str(raised.value) == ("w: the checkpoint's chunks cover 0 of the 4 elements needed for region offsets=(0,) "
                                 "sizes=(4,); the checkpoint is incomplete or its manifest is damaged")


def test_a_rank_plan_names_the_tensor_it_cannot_fill():
    index = index_chunks([_c((4, 2), (0, 0), (2, 2), 0)])
    plan = plan_rank(index, [Target("w", "param", (0, 0), (1, 2))])
    assert plan.rank == 0 and plan.received == []
    with pytest.raises(CheckpointError) as raised:
        plan_rank(index, [Target("w", "param", (1, 0), (2, 2))], rank=3)
    assert str(raised.value) == ("w (param): the checkpoint's chunks cover 2 of the 4 elements needed for region "
                                 "offsets=(1, 0) sizes=(2, 2); the checkpoint is incomplete or its manifest is damaged")


# ---- messages worked by hand: the tiling check and the planner on a stacked expert tensor ----------

from rayshard.plans.checkpoint.reshard import _check_tensor  # noqa: E402

GATE_UP = "layers.1.feed_forward.experts.gate_up.weight"


def piece(first, count):
    """Experts first .. first+count-1 of an 8 x 4 x 2 expert tensor (32 bytes an expert)."""
    return _c((8, 4, 2), (first, 0, 0), (count, 4, 2), 1000 * first, name=GATE_UP)


def test_the_tiling_check_names_the_missing_experts():
    with pytest.raises(CheckpointError) as raised:
        check_chunks_disjoint_and_complete([piece(0, 4)])
    assert str(raised.value) == (f"{GATE_UP} (param): chunks hold 32 elements, global shape (8, 4, 2) needs 64"
                                 " (experts missing or incomplete: expert 4-7)")
    with pytest.raises(CheckpointError) as raised:
        _check_tensor(GATE_UP, "param", [piece(0, 4), piece(8, 4)])
    assert str(raised.value) == (f"{GATE_UP} (param): chunk at (8, 0, 0) size (4, 4, 2) lies outside the global shape "
                                 "(8, 4, 2) (experts missing or incomplete: expert 4-7; beyond the model's 8 experts: "
                                 "expert 8-11)")
    with pytest.raises(CheckpointError) as raised:
        _check_tensor(GATE_UP, "param", [piece(0, 4), piece(2, 4)])  # 2-3 twice, 6-7 missing: the same volume
    assert str(raised.value) == (f"{GATE_UP} (param): chunks at (0, 0, 0) and (2, 0, 0) overlap"
                                 " (experts missing or incomplete: expert 6-7; stored twice: expert 2-3)")


def test_the_planner_names_the_experts_a_region_lacks():
    with pytest.raises(CheckpointError) as raised:
        plan_reads([piece(0, 4)], (2, 0, 0), (4, 4, 2), "gate_up (param)")
    assert str(raised.value) == ("gate_up (param): the checkpoint's chunks cover 16 of the 32 elements needed for region "
                                 "offsets=(2, 0, 0) sizes=(4, 4, 2) (experts missing or incomplete: expert 4-5); "
                                 "the checkpoint is incomplete or its manifest is damaged")
    # No stored chunk overlaps the region: the note still comes, from the tensor's first chunk.
    with pytest.raises(CheckpointError) as raised:
        plan_reads([piece(0, 4)], (4, 0, 0), (4, 4, 2), "gate_up (param)")
    assert str(raised.value) == ("gate_up (param): the checkpoint's chunks cover 0 of the 32 elements needed for region "
                                 "offsets=(4, 0, 0) sizes=(4, 4, 2) (experts missing or incomplete: expert 4-7); "
                                 "the checkpoint is incomplete or its manifest is damaged")


def test_the_sweep_words_each_failure():
    chunks = [_c((10, 6), (0, 0), (5, 6), 0), _c((10, 7), (5, 0), (5, 6), 120)]
    with pytest.raises(CheckpointError) as raised:
        _check_tensor("w", "param", chunks)
    assert str(raised.value) == "w (param): chunks disagree on the global shape ((10, 6) vs (10, 7))"
    scalar = _c((), (), (), 0, name="s")
    _check_tensor("s", "param", [scalar])  # a lone scalar tiles its tensor
    check_chunks_disjoint_and_complete([scalar])


def test_a_scalar_chunk_against_a_region_of_another_rank():
    scalar = _c((), (), (), 0, name="s")
    for index in ([scalar], index_chunks([scalar])[("s", "param")]):
        # Wherever the region's dim 0 falls, in the scalar's one row or past it, the rank is named.
        for offsets in ((0,), (1,), (3,)):
            with pytest.raises(CheckpointError) as raised:
                plan_reads(index, offsets, (1,), "s")
            assert str(raised.value) == "s: stored rank 0 differs from target rank 1"


def test_a_region_of_another_rank_is_named_wherever_its_rows_fall():
    chunks = [_c((6, 2), (0, 0), (3, 2), 0), _c((6, 2), (3, 0), (3, 2), 24)]
    for index in (chunks, index_chunks(chunks)[("w", "param")]):
        for offsets in ((0,), (5,), (9,)):  # in the first chunk's rows, the second's, past both
            with pytest.raises(CheckpointError) as raised:
                plan_reads(index, offsets, (1,), "w")
            assert str(raised.value) == "w: stored rank 2 differs from target rank 1"
        with pytest.raises(CheckpointError) as raised:
            plan_reads(index, (), (), "w")
        assert str(raised.value) == "w: stored rank 2 differs from target rank 0"


def test_a_tensor_with_no_chunks_covers_nothing():
    with pytest.raises(CheckpointError) as raised:
        plan_reads([], (0,), (2,), "w")
    assert str(raised.value) == ("w: the checkpoint's chunks cover 0 of the 2 elements needed for region offsets=(0,) "
                                 "sizes=(2,); the checkpoint is incomplete or its manifest is damaged")
    assert plan_reads([], (0,), (0,), "w") == []  # an empty region needs no chunk


def test_chunks_that_disagree_on_their_rank_are_refused_at_the_one_that_differs():
    # A damaged list: the first chunk (which sets the tensor's rank) is 2-D, a later one 1-D.
    chunks = [_c((6, 2), (0, 0), (3, 2), 0), _c((6,), (3,), (3,), 24)]
    with pytest.raises(CheckpointError) as raised:
        plan_reads(chunks, (3, 0), (3, 2), "w")
    assert str(raised.value) == "w: stored rank 1 differs from target rank 2"
    # plan_reads looks only at the chunks its region overlaps (found by bisection on dim 0; the
    # manifest check, `check_chunks_disjoint_and_complete`, refuses such a list before planning):
    # rows 0-2 are read from the first chunk alone.
    assert _spans(plan_reads(chunks, (0, 0), (3, 2), "w")) == [(0, 24, (0, 0), (3, 2), (0, 0), (3, 2))]


def test_the_index_refuses_a_tensor_it_does_not_hold_by_its_key():
    index = index_chunks([_c((4,), (0,), (4,), 0, name="w"), _c((2,), (0,), (2,), 16, name="v", kind="exp_avg")])
    for key in (("v", "param"), ("w", "exp_avg"), ("u", "param")):
        with pytest.raises(KeyError) as raised:
            index[key]
        assert raised.value.args == (key,)
    assert list(index) == [("w", "param"), ("v", "exp_avg")] and index[("w", "param")] is index[("w", "param")]



@pytest.mark.parametrize("chunks, message", [
    # Offsets naming one dim of a 2-d tensor: every count and bound agrees, only the lengths do not.
    ([_c((4, 2), (0,), (4, 2), 0)], "w (param): chunk at (0,) size (4, 2) lies outside the global shape (4, 2)"),
    # Sizes naming one dim, twice: 8 of 8 elements, but the two chunks are the same rows.
    ([_c((4, 2), (0, 0), (4,), 0), _c((4, 2), (0, 1), (4,), 16)], "w (param): chunks at (0, 0) and (0, 1) overlap"),
    # One element of four: held 1.
    ([_c((4,), (1,), (1,), 0)], "w (param): chunks hold 1 elements, global shape (4,) needs 4"),
    # An empty chunk of w next to a tensor with no elements at all: held 0 of 4.
    ([_c((0,), (0,), (0,), 0, name="z"), _c((4,), (0,), (0,), 0)], "w (param): chunks hold 0 elements, global shape (4,) needs 4"),
    # After a sound tensor, w's two chunks overlap at row 2 and miss row 5: 6 of 6 elements held.
    ([_c((2,), (0,), (2,), 0, name="a"), _c((6,), (0,), (3,), 8), _c((6,), (2,), (3,), 20)],
     "w (param): chunks at (0,) and (2,) overlap"),
    # Column blocks 0-2 and 2-3 overlap at column 2 (rows 0-1) and miss column 3 (rows 2-3): 16 of 16 held.
    ([_c((4, 4), (0, 0), (4, 3), 0), _c((4, 4), (0, 2), (2, 2), 48)], "w (param): chunks at (0, 0) and (0, 2) overlap"),
    # After a sound tensor, column blocks 0-1, 1-3 and 2-4 of w: 1-3 and 2-4 overlap at column 2 (rows
    # 0-1), column 3 misses rows 2-3: 16 of 16 held.
    ([_c((2,), (0,), (2,), 0, name="a"), _c((4, 4), (0, 0), (4, 1), 8), _c((4, 4), (0, 1), (4, 2), 24),
      _c((4, 4), (0, 2), (2, 2), 56)], "w (param): chunks at (0, 1) and (0, 2) overlap"),
    # Two damaged tensors: the first listed is named, whatever the order of their dictionary codes
    # (b's exp_avg comes first, so (b, param) sorts before (a, param)).
    ([_c((2,), (0,), (2,), 0, name="b", kind="exp_avg"), _c((4,), (0,), (2,), 8, name="a"),
      _c((4,), (0,), (3,), 16, name="b")], "a (param): chunks hold 2 elements, global shape (4,) needs 4"),
    # 2 x 2: (0, 0) alone, row 1 whole, and (1, 1) again: 4 of 4 held, (1, 1) twice, (0, 1) missing.
    ([_c((2, 2), (0, 0), (1, 1), 0), _c((2, 2), (1, 1), (1, 1), 4), _c((2, 2), (1, 0), (1, 2), 8)],
     "w (param): chunks at (1, 0) and (1, 1) overlap"),
    # A sound matrix first, then a vector overlapping itself and missing its last element.
    ([_c((2, 2), (0, 0), (2, 2), 0, name="m"), _c((6,), (0,), (3,), 16), _c((6,), (2,), (3,), 28)],
     "w (param): chunks at (0,) and (2,) overlap"),
])
def test_damage_only_the_columns_can_see_goes_to_the_sweep(chunks, message):
    with pytest.raises(CheckpointError) as raised:
        check_chunks_disjoint_and_complete(chunks)
    assert str(raised.value) == message


def test_the_index_lists_tensors_in_first_listed_order_over_many_rows():
    # a, b, c, then (c, c, b, a) sixty times: 243 rows, each tensor's rows spread over the table.
    pattern, rows = ["a", "b", "c"] + ["c", "c", "b", "a"] * 60, {}
    chunks = []
    for name in pattern:
        row = rows[name] = rows.get(name, -1) + 1
        chunks.append(_c((200,), (row,), (1,), 4 * len(chunks), name=name))
    index = index_chunks(chunks)
    assert list(index) == [("a", "param"), ("b", "param"), ("c", "param")] and len(index) == 3
    assert [len(index[(n, "param")].chunks) for n in "abc"] == [61, 61, 121]


def test_the_index_finds_a_tensor_whose_key_passes_two_to_the_sixteen():
    # 257 names and 256 kinds: the key of (n256, k0) is 256 * 256 + 0 = 65536, one past uint16.
    chunks = [_c((1,), (0,), (1,), 4 * i, name=f"n{i}", kind="k0") for i in range(257)]
    chunks += [_c((1,), (0,), (1,), 2000 + 4 * i, name="n0", kind=f"k{i}") for i in range(1, 256)]
    index = index_chunks(chunks)
    assert [c.byte_start for c in index[("n256", "k0")].chunks] == [1024]
    assert [c.byte_start for c in index[("n0", "k0")].chunks] == [0]
    assert [c.byte_start for c in index[("n0", "k255")].chunks] == [2000 + 4 * 255]
    assert list(index)[:2] == [("n0", "k0"), ("n1", "k0")] and len(index) == 512
