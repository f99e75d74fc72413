"""The read planner over random chunkings: exact coverage, and executing the plan on real
safetensors bytes reproduces the target region of the global tensor bit for bit."""
import itertools
import uuid

import fsspec
import pytest
import torch
from hypothesis import given, settings, strategies as st

from actors.checkpoint_io import encode_shard, fill_from_reads
from plans.errors import CheckpointError
from plans.reshard import check_chunks_disjoint_and_complete, plan_reads


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
        pieces_per_file[index % files].append(("w", "param", piece, shape, tuple(a for a, _ in box)))
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
    _, chunks = encode_shard([("w", "param", tensor[:2], (4, 3), (0, 0))], "a")
    with pytest.raises(CheckpointError, match="cover 6 of the 12"):
        plan_reads(chunks, (0, 0), (4, 3), what="w")
    with pytest.raises(CheckpointError, match="chunks hold 6 elements"):
        check_chunks_disjoint_and_complete(chunks)
    _, overlapping = encode_shard([("w", "param", tensor[:3], (4, 3), (0, 0)),
                                   ("w", "param", tensor[1:2], (4, 3), (1, 0))], "b")
    with pytest.raises(CheckpointError, match="overlap|chunks hold"):
        check_chunks_disjoint_and_complete(overlapping)
