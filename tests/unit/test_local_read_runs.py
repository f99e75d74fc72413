"""Local loads read back-to-back parts in one scatter read and check each whole chunk block by
block as it lands (`actors/checkpoint/read_executor._execute_local`). These cases put every kind of part in
one file and one plan: parts read straight into contiguous destinations, column chunks staged
into rows of wider ones, whole rows staged for a narrow column range, a non-contiguous
destination, bfloat16, int64, a 0-d tensor, header checks, and parts that overlap (two targets
reading the same rows), so one request is cut into several runs."""
import os
import zlib
from dataclasses import replace

import fsspec
import pytest
import torch
from hypothesis import given, settings, strategies as st

from rayshard.actors.checkpoint import read_executor
from rayshard.actors.checkpoint.read_executor import Destination, execute_requests
from rayshard.actors.checkpoint.shard_writer import Piece, encode_shard
from rayshard.plans.errors import CheckpointError
from rayshard.plans.checkpoint.reshard import HeaderCheck, Target, coalesce, header_checks, index_chunks, plan_rank

FILE = "attempt-x/rank-00000.safetensors"


def _asymmetric(shape, dtype, salt):
    """Values that differ across rows, columns and tensors (a swapped half or transpose shows)."""
    count = torch.Size(shape).numel()
    values = (torch.arange(count, dtype=torch.float64) * (7 + salt) % 101 - 50 + salt / 8).reshape(shape)
    return values.to(dtype)


WHOLE = {
    "a": _asymmetric((6, 10), torch.float32, 1),
    "b": _asymmetric((8, 6), torch.bfloat16, 2),
    "c": _asymmetric((5,), torch.int64, 3),
    "d": _asymmetric((), torch.float32, 4),
    "e": _asymmetric((7, 9), torch.float32, 5),
    "f": _asymmetric((4, 3), torch.float32, 6),
}


def _write(tmp_path):
    cut = 4  # e is stored as two uneven column chunks, as a tp split writes it
    pieces = [Piece("a", "param", WHOLE["a"], (6, 10), (0, 0)),
              Piece("b", "exp_avg", WHOLE["b"], (8, 6), (0, 0)),
              Piece("c", "param", WHOLE["c"], (5,), (0,)),
              Piece("d", "param", WHOLE["d"], (), ()),
              Piece("e", "param", WHOLE["e"][:, :cut].contiguous(), (7, 9), (0, 0)),
              Piece("e", "param", WHOLE["e"][:, cut:].contiguous(), (7, 9), (0, cut)),
              Piece("f", "param", WHOLE["f"], (4, 3), (0, 0))]
    data, chunks = encode_shard(pieces, FILE)
    (tmp_path / "attempt-x").mkdir()
    (tmp_path / FILE).write_bytes(data)
    return data, chunks


def _plan_and_destinations(chunks, e_rows_read_twice=True):
    """Targets (name, kind, offsets, sizes) -> destination tensors, filled with a sentinel."""
    wanted = {
        Target("a", "param", (0, 0), (6, 10)): torch.full((6, 10), -1.0),  # whole chunk, contiguous
        Target("b", "exp_avg", (2, 0), (4, 6)): torch.full((4, 6), -1.0).to(torch.bfloat16),  # some rows
        Target("c", "param", (0,), (5,)): torch.full((5,), -1, dtype=torch.int64),
        Target("d", "param", (), ()): torch.tensor(-1.0),
        Target("e", "param", (1, 0), (5, 9)): torch.full((5, 9), -1.0),  # rows of both column chunks: scattered
        # The transpose of a contiguous tensor: not contiguous, so staged and copied.
        Target("f", "param", (0, 0), (4, 3)): torch.full((3, 4), -1.0).t(),
    }
    if e_rows_read_twice:
        # Two columns of every row of e's first chunk: short row segments, so whole rows are read
        # (and staged), overlapping the scattered rows above in the same request.
        wanted[Target("e", "param", (0, 1), (7, 2))] = torch.full((7, 2), -1.0)
    plan = plan_rank(index_chunks(chunks), list(wanted), headers=header_checks(chunks), min_segment_bytes=1 << 20)
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    return plan, wanted, by_item


def _expected(target):
    region = tuple(slice(o, o + s) for o, s in zip(target.offsets, target.sizes))
    return WHOLE[target.name][region] if region else WHOLE[target.name]


def _bits(tensor):
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _seven_bytes_a_call(monkeypatch):
    """The system returns at most 7 bytes a call, into the first buffer only (as FUSE mounts may)."""
    def preadv_seven_bytes(descriptor, buffers, offset):
        first = memoryview(buffers[0]).cast("B")
        data = os.pread(descriptor, min(7, first.nbytes), offset)
        first[:len(data)] = data
        return len(data)

    monkeypatch.setattr(read_executor.os, "preadv", preadv_seven_bytes)


@pytest.mark.parametrize("block_bytes", [16, 1 << 20])
@pytest.mark.parametrize("short_reads", [False, True])
def test_every_kind_of_part_lands_bit_for_bit_in_one_plan(tmp_path, monkeypatch, block_bytes, short_reads):
    monkeypatch.setattr(read_executor, "CHECK_BLOCK_BYTES", block_bytes)
    if short_reads:
        _seven_bytes_a_call(monkeypatch)
    _, chunks = _write(tmp_path)
    plan, wanted, by_item = _plan_and_destinations(chunks)
    parts = [request.parts for request in plan.requests]
    assert any(b.byte_start < a.byte_end for run in parts for a, b in zip(run, run[1:]))  # a request cut in runs
    served = []
    read = execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item, served=served.append)
    for target, tensor in wanted.items():
        assert torch.equal(_bits(tensor), _bits(_expected(target))), target
    assert sorted(map(id, served)) == sorted(id(item) for items in plan.items.values() for item in items)
    assert read == sum(part.nbytes for run in parts for part in run)  # overlapping rows are read twice


@pytest.mark.parametrize("block_bytes", [16, 1 << 20])
@pytest.mark.parametrize("victim", ["a", "c", "d", "f"])
def test_a_changed_byte_in_any_whole_chunk_names_that_tensor(tmp_path, monkeypatch, block_bytes, victim):
    monkeypatch.setattr(read_executor, "CHECK_BLOCK_BYTES", block_bytes)
    data, chunks = _write(tmp_path)
    chunk = next(c for c in chunks if c.name == victim)
    _flip(tmp_path, data, (chunk.byte_start + chunk.byte_end) // 2, 0x04)
    plan, _, by_item = _plan_and_destinations(chunks)
    _assert_checksum_mismatch(tmp_path, plan, by_item, chunk)


def _flip(tmp_path, data: bytes, position: int, mask: int) -> None:
    """Rewrite the checkpoint file with one byte changed."""
    changed = bytearray(data)
    changed[position] ^= mask
    (tmp_path / FILE).write_bytes(bytes(changed))


def _assert_checksum_mismatch(tmp_path, plan, by_item, chunk) -> None:
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value) == (f"{tmp_path}/{FILE}: checksum mismatch for {chunk.name} (param) at bytes "
                                 f"[{chunk.byte_start}, {chunk.byte_end}); the file changed or is corrupt. Fix: restore "
                                 "it from a copy, or resume from another checkpoint")


def test_a_changed_header_is_caught_when_a_chunk_is_read_only_in_part(tmp_path):
    data, chunks = _write(tmp_path)
    changed = bytearray(data)
    changed[9] ^= 0x01  # inside the JSON header; e is read only in part, so its header is checked
    (tmp_path / FILE).write_bytes(bytes(changed))
    plan, _, by_item = _plan_and_destinations(chunks)
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value) == (f"{tmp_path}/{FILE}: its safetensors header differs from the one recorded in the "
                                 "manifest; the file was replaced or rewritten after the checkpoint was committed. Fix: "
                                 "restore the original file, or resume from another checkpoint")


@pytest.mark.parametrize("short_reads", [False, True])
def test_a_file_cut_short_names_the_first_part_it_cannot_supply(tmp_path, monkeypatch, short_reads):
    if short_reads:
        _seven_bytes_a_call(monkeypatch)
    data, chunks = _write(tmp_path)
    c, d = (next(chunk for chunk in chunks if chunk.name == name) for name in "cd")
    assert c.byte_end == d.byte_start  # c and d are read in one run; the cut falls in d, not c
    (tmp_path / FILE).write_bytes(data[:d.byte_start + 2])
    plan, wanted, by_item = _plan_and_destinations(chunks, e_rows_read_twice=False)
    with pytest.raises(CheckpointError, match=rf"expected bytes \[{d.byte_start}, {d.byte_end}\) of d \(param\).*"
                                              "missing or truncated"):
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)


@st.composite
def tensors_and_targets(draw):
    """1-3 tensors of random shapes and dtypes, each cut into a random grid of chunks spread over
    1-2 files, and one random target region of each (contiguous or a transposed destination)."""
    cases = []
    for number in range(draw(st.integers(1, 3))):
        ndim = draw(st.integers(0, 3))
        shape = tuple(draw(st.integers(1, 7)) for _ in range(ndim))
        cuts = [[0, *sorted(draw(st.sets(st.integers(1, size - 1), max_size=2))), size] if size > 1 else [0, size]
                for size in shape]
        lo = tuple(draw(st.integers(0, size - 1)) for size in shape)
        sizes = tuple(draw(st.integers(1, size - low)) for low, size in zip(lo, shape))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
        transposed = ndim == 2 and draw(st.booleans())
        cases.append((f"t{number}", shape, cuts, lo, sizes, dtype, transposed))
    return cases, draw(st.integers(1, 2)), draw(st.sampled_from([1, 24, 1 << 20])), draw(st.sampled_from([8, 40, 1 << 20]))


@settings(max_examples=60, deadline=None)
@given(tensors_and_targets())
def test_random_plans_read_from_local_files_reproduce_every_target(case):
    import itertools
    import shutil
    import tempfile

    cases, files, min_segment_bytes, block_bytes = case
    base = tempfile.mkdtemp(prefix="rayshard-runs-")
    pieces_per_file = [[] for _ in range(files)]
    wholes, wanted = {}, {}
    for salt, (name, shape, cuts, lo, sizes, dtype, transposed) in enumerate(cases):
        whole = wholes[name] = _asymmetric(shape, dtype, salt)
        for index, box in enumerate(itertools.product(*[list(zip(c[:-1], c[1:])) for c in cuts])):
            region = tuple(slice(a, b) for a, b in box)
            pieces_per_file[(index + salt) % files].append(Piece(name, "param", whole[region].contiguous(), shape,
                                                            tuple(a for a, _ in box)))
        destination = torch.zeros(tuple(reversed(sizes)), dtype=dtype).t() if transposed else torch.zeros(sizes, dtype=dtype)
        wanted[Target(name, "param", lo, sizes)] = destination.fill_(-3)
    chunks = []
    for number, pieces in enumerate(pieces_per_file):
        if pieces:
            data, written = encode_shard(pieces, f"f{number}.safetensors")
            with open(f"{base}/f{number}.safetensors", "wb") as handle:
                handle.write(data)
            chunks += written
    plan = plan_rank(index_chunks(chunks), list(wanted), headers=header_checks(chunks), min_segment_bytes=min_segment_bytes)
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    saved = read_executor.CHECK_BLOCK_BYTES
    read_executor.CHECK_BLOCK_BYTES = block_bytes
    try:
        execute_requests(fsspec.filesystem("file"), base, plan.requests, by_item)
    finally:
        read_executor.CHECK_BLOCK_BYTES = saved
        shutil.rmtree(base, ignore_errors=True)
    for target, tensor in wanted.items():
        region = tuple(slice(o, o + s) for o, s in zip(target.offsets, target.sizes))
        assert torch.equal(_bits(tensor), _bits(wholes[target.name][region] if region else wholes[target.name])), target


@pytest.mark.parametrize("short_reads", [False, True])
def test_chunks_cut_along_two_trailing_dims_land_in_a_whole_target(tmp_path, monkeypatch, short_reads):
    """A (2, 6, 4) tensor stored as a 2 x 2 grid over its last two dims (tp over two dims): each
    chunk lands as 2 x 3 runs of 2 elements, over two outer dims (staged, then copied)."""
    if short_reads:
        _seven_bytes_a_call(monkeypatch)
    whole = _asymmetric((2, 6, 4), torch.float32, 9)
    pieces = [Piece("g", "param", whole[:, a:a + 3, b:b + 2].contiguous(), (2, 6, 4), (0, a, b)) for a in (0, 3) for b in (0, 2)]
    data, chunks = encode_shard(pieces, "f.safetensors")
    (tmp_path / "f.safetensors").write_bytes(data)
    target, destination = Target("g", "param", (0, 0, 0), (2, 6, 4)), torch.full((2, 6, 4), -1.0)
    plan = plan_rank(index_chunks(chunks), [target], headers=header_checks(chunks))
    assert all(read_executor._direct_buffer(item, Destination(destination, (0, 0, 0))) is None for item in plan.items[target])
    execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests,
                     {item: Destination(destination, (0, 0, 0)) for item in plan.items[target]})
    assert torch.equal(destination, whole)


def test_a_staged_part_cut_short_names_its_range_and_how_far_it_got(tmp_path, monkeypatch):
    # f lands in a transposed (non-contiguous) destination, so it is staged: with 16-byte blocks,
    # one 12-byte row at a time. Cut 17 bytes in, the second row comes back with 5 of its 12.
    monkeypatch.setattr(read_executor, "CHECK_BLOCK_BYTES", 16)
    data, chunks = _write(tmp_path)
    f = next(chunk for chunk in chunks if chunk.name == "f")
    assert f.byte_end == len(data)  # f is last: every other part is whole
    (tmp_path / FILE).write_bytes(data[:f.byte_start + 17])
    plan, _, by_item = _plan_and_destinations(chunks, e_rows_read_twice=False)
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value) == (f"{tmp_path}/{FILE}: expected bytes [{f.byte_start}, {f.byte_end}) of f (param) but got "
                                 "17 bytes; the shard is missing or truncated. Fix: restore the file, or resume from an "
                                 "earlier checkpoint")


def test_a_short_request_names_at_most_three_tensors_and_a_cut_header_is_named_as_such(tmp_path):
    data, chunks = _write(tmp_path)
    wanted = {Target(name, kind, (0,) * WHOLE[name].dim(), tuple(WHOLE[name].shape)): torch.empty_like(WHOLE[name])
              for name, kind in [("a", "param"), ("b", "exp_avg"), ("c", "param"), ("d", "param")]}
    items = plan_rank(index_chunks(chunks), list(wanted)).items
    whole = {item: Destination(wanted[target], target.offsets) for target, found in items.items() for item in found}
    (request,) = coalesce(whole)  # a, b, c and d lie back to back: one object-store GET
    fs, base = fsspec.core.url_to_fs(f"memory://short-{os.getpid()}-{id(tmp_path)}")
    fs.pipe_file(f"{base}/{FILE}", data[:request.byte_end - 1])
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fs, base, [request], whole)
    assert str(failed.value).startswith(f"{base}/{FILE}: expected bytes [{request.byte_start}, {request.byte_end}) of "
                                        f"a (param), b (exp_avg), c (param) ... but got {request.nbytes - 1} bytes; ")
    plan, _, by_item = _plan_and_destinations(chunks, e_rows_read_twice=False)
    (tmp_path / FILE).write_bytes(data[:5])  # the local path, cut inside the header it checks first
    header = header_checks(chunks)[FILE]
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value).startswith(f"{tmp_path}/{FILE}: expected bytes [0, {header.byte_end}) of the safetensors "
                                        "header but got 5 bytes; ")
    fs.rm(f"{base}/{FILE}")


def _no_scatter_reads(monkeypatch):
    """A platform without os.preadv: every read is a seek and a readinto per buffer."""
    monkeypatch.setattr(read_executor, "_SCATTER_READS", False)
    monkeypatch.delattr(read_executor.os, "preadv")


def test_every_kind_of_part_lands_bit_for_bit_without_scatter_reads(tmp_path, monkeypatch):
    _no_scatter_reads(monkeypatch)
    monkeypatch.setattr(read_executor, "CHECK_BLOCK_BYTES", 16)
    _, chunks = _write(tmp_path)
    plan, wanted, by_item = _plan_and_destinations(chunks)
    read = execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    for target, tensor in wanted.items():
        assert torch.equal(_bits(tensor), _bits(_expected(target))), target
    assert read == sum(part.nbytes for request in plan.requests for part in request.parts)


@pytest.mark.parametrize("scatter", [True, False])
@pytest.mark.parametrize("extra", [2, 0])  # inside d, or exactly at the end of c: d is still the part that lacks bytes
def test_a_file_cut_short_names_the_part_with_how_many_of_its_bytes_arrived(tmp_path, monkeypatch, scatter, extra):
    if not scatter:
        _no_scatter_reads(monkeypatch)
    data, chunks = _write(tmp_path)
    d = next(chunk for chunk in chunks if chunk.name == "d")
    (tmp_path / FILE).write_bytes(data[:d.byte_start + extra])
    plan, _, by_item = _plan_and_destinations(chunks, e_rows_read_twice=False)
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value).startswith(f"{tmp_path}/{FILE}: expected bytes [{d.byte_start}, {d.byte_end}) of d (param) "
                                        f"but got {extra} bytes; ")


def test_a_destination_of_another_dtype_is_refused_not_filled_with_raw_bytes(tmp_path):
    _, chunks = _write(tmp_path)
    wanted = Target("a", "param", (0, 0), (6, 10))
    plan = plan_rank(index_chunks(chunks), [wanted])
    destination = torch.zeros((6, 10), dtype=torch.int32)  # as many bytes as a's float32: a raw copy would fit
    by_item = {item: Destination(destination, wanted.offsets) for items in plan.items.values() for item in items}
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value).startswith(f"{tmp_path}/{FILE}: a (param) is stored as float32, the model expects int32. Fix: ")


def test_a_local_chunk_whose_checksum_algorithm_is_unknown_is_refused_naming_the_file(tmp_path):
    _, chunks = _write(tmp_path)
    chunks = [replace(c, checksum="md5:0") if c.name == "a" else c for c in chunks]
    plan = plan_rank(index_chunks(chunks), [Target("a", "param", (0, 0), (6, 10))])
    by_item = {item: Destination(torch.empty(6, 10), (0, 0)) for items in plan.items.values() for item in items}
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value).startswith(f"{tmp_path}/{FILE}: checksum 'md5:0' uses 'md5', which this rayshard cannot verify")


def _spy_reads(monkeypatch):
    """Record (file offset, bytes asked for) of every read the executor makes."""
    reads, read_into = [], read_executor._read_into

    def recording_read_into(handle, start, segments):
        reads.append((start, sum(memoryview(s).nbytes for s in segments)))
        return read_into(handle, start, segments)

    monkeypatch.setattr(read_executor, "_read_into", recording_read_into)
    return reads


def _never_staged(monkeypatch):
    def staged(handle, path, part, destination, scratch, report):
        raise AssertionError(f"{part.chunk.name} staged, not read in place")

    monkeypatch.setattr(read_executor, "_read_staged", staged)


def test_a_same_layout_load_reads_every_part_in_place_and_stages_nothing(tmp_path, monkeypatch):
    """Whole chunks (2-D, 1-D, a 1-element 0-d) and whole rows of one, each into a contiguous
    destination of its dtype: every part is read straight into the destination's memory."""
    _, chunks = _write(tmp_path)
    wanted = {Target("a", "param", (0, 0), (6, 10)): torch.full((6, 10), -1.0),
              Target("b", "exp_avg", (2, 0), (4, 6)): torch.full((4, 6), -1.0).to(torch.bfloat16),
              Target("c", "param", (0,), (5,)): torch.full((5,), -1, dtype=torch.int64),
              Target("d", "param", (), ()): torch.tensor(-1.0)}
    plan = plan_rank(index_chunks(chunks), list(wanted), headers=header_checks(chunks))
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    for item, destination in by_item.items():
        direct = read_executor._direct_buffer(item, destination)
        assert direct is not None and direct.nbytes == item.nbytes, item.chunk.name
    _never_staged(monkeypatch)
    execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    for target, tensor in wanted.items():
        assert torch.equal(_bits(tensor), _bits(_expected(target))), target


@pytest.mark.parametrize("shape, cut_dim, cut", [((4, 3, 2), 0, 2),  # rows of a 3-D tensor: each lands in place
                                                 ((2, 6, 4), 1, 3),  # its middle dim: strided, staged
                                                 ((4, 4), 1, 2),  # columns of a square one: staged
                                                 ((3, 5, 2, 2), 0, 1)])  # rows of a 4-D one: in place
def test_chunks_cut_along_one_dim_land_bit_for_bit_in_a_whole_target(tmp_path, shape, cut_dim, cut):
    whole = _asymmetric(shape, torch.float32, 11)
    lo = [slice(None)] * len(shape)
    hi = [slice(None)] * len(shape)
    lo[cut_dim], hi[cut_dim] = slice(0, cut), slice(cut, None)
    offset = tuple(cut if dim == cut_dim else 0 for dim in range(len(shape)))
    pieces = [Piece("g", "param", whole[tuple(lo)].contiguous(), shape, (0,) * len(shape)),
              Piece("g", "param", whole[tuple(hi)].contiguous(), shape, offset)]
    data, chunks = encode_shard(pieces, "f.safetensors")
    (tmp_path / "f.safetensors").write_bytes(data)
    target, destination = Target("g", "param", (0,) * len(shape), shape), torch.full(shape, -1.0)
    plan = plan_rank(index_chunks(chunks), [target])
    by_item = {item: Destination(destination, target.offsets) for item in plan.items[target]}
    direct = [read_executor._direct_buffer(item, by_item[item]) is not None for item in plan.items[target]]
    assert direct == [cut_dim == 0] * 2
    assert execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item) == whole.numel() * 4
    assert torch.equal(destination, whole)


def _overlapping_plan(chunks):
    """All of a, and rows 2..5 of a again for a second destination; all of c, and elements 1..4
    of c again: in each of the two requests two parts read in place overlap, so it is read as
    two runs."""
    wanted = {Target("a", "param", (0, 0), (6, 10)): torch.full((6, 10), -1.0),
              Target("a", "param", (2, 0), (3, 10)): torch.full((3, 10), -1.0),
              Target("c", "param", (0,), (5,)): torch.full((5,), -1, dtype=torch.int64),
              Target("c", "param", (1,), (3,)): torch.full((3,), -1, dtype=torch.int64)}
    plan = plan_rank(index_chunks(chunks), list(wanted))
    assert len(plan.requests) == 2
    for request in plan.requests:
        first, second = request.parts
        assert first.byte_start < second.byte_start < first.byte_end
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    return plan, wanted, by_item


@pytest.mark.parametrize("short_reads", [False, True])
def test_parts_read_in_place_that_overlap_each_get_their_own_bytes(tmp_path, monkeypatch, short_reads):
    if short_reads:
        _seven_bytes_a_call(monkeypatch)
    _, chunks = _write(tmp_path)
    plan, wanted, by_item = _overlapping_plan(chunks)
    _never_staged(monkeypatch)
    served = []
    read = execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item, served=served.append)
    for target, tensor in wanted.items():
        assert torch.equal(tensor, _expected(target)), target
    assert read == 240 + 120 + 40 + 24  # the overlapping rows are read twice
    assert sorted(map(id, served)) == sorted(map(id, by_item))


def test_a_changed_byte_in_a_chunk_read_before_an_overlapping_part_names_the_file_and_tensor(tmp_path):
    data, chunks = _write(tmp_path)
    a = next(chunk for chunk in chunks if chunk.name == "a")
    _flip(tmp_path, data, a.byte_start + 7, 0x08)  # row 0: only the whole read of a holds it
    plan, _, by_item = _overlapping_plan(chunks)
    _assert_checksum_mismatch(tmp_path, plan, by_item, a)


def test_a_header_check_with_an_unknown_algorithm_is_refused_naming_the_file(tmp_path):
    _, chunks = _write(tmp_path)
    headers = {file: replace(check, checksum="md5:0") for file, check in header_checks(chunks).items()}
    plan = plan_rank(index_chunks(chunks), [Target("e", "param", (1, 0), (5, 9))], headers=headers)
    assert any(isinstance(part, HeaderCheck) for request in plan.requests for part in request.parts)
    by_item = {item: Destination(torch.empty(5, 9), (1, 0)) for items in plan.items.values() for item in items}
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value).startswith(f"{tmp_path}/{FILE}: checksum 'md5:0' uses 'md5', which this rayshard cannot verify")


def test_a_missing_local_file_names_its_path_range_and_tensors(tmp_path):
    _, chunks = _write(tmp_path)
    wanted = {Target(name, kind, (0,) * WHOLE[name].dim(), tuple(WHOLE[name].shape)): torch.empty_like(WHOLE[name])
              for name, kind in [("a", "param"), ("b", "exp_avg"), ("c", "param"), ("d", "param")]}
    plan = plan_rank(index_chunks(chunks), list(wanted))
    (request,) = plan.requests  # a, b, c and d lie back to back
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    (tmp_path / FILE).unlink()
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value).startswith(f"{tmp_path}/{FILE}: expected bytes [{request.byte_start}, {request.byte_end}) of "
                                        "a (param), b (exp_avg), c (param) ... but got an error: ")


def test_a_local_load_warns_about_nothing(tmp_path, monkeypatch):
    """No warning leaks from a load, even with torch warning every time instead of once a process."""
    import warnings

    _, chunks = _write(tmp_path)
    plan, wanted, by_item = _plan_and_destinations(chunks)
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
            _no_scatter_reads(monkeypatch)
            execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    finally:
        torch.set_warn_always(False)
    for target, tensor in wanted.items():
        assert torch.equal(_bits(tensor), _bits(_expected(target))), target


def test_a_header_read_in_one_run_with_a_big_chunk_part_checked_in_small_blocks(tmp_path, monkeypatch):
    """The header's bytes (read whole, unchecked) and many checked blocks after it in one run."""
    monkeypatch.setattr(read_executor, "CHECK_BLOCK_BYTES", 16)
    whole = _asymmetric((64, 16), torch.float32, 12)
    data, chunks = encode_shard([Piece("big", "param", whole, (64, 16), (0, 0))], FILE)
    (tmp_path / "attempt-x").mkdir()
    (tmp_path / FILE).write_bytes(data)
    target, destination = Target("big", "param", (0, 0), (40, 16)), torch.full((40, 16), -1.0)
    plan = plan_rank(index_chunks(chunks), [target], headers=header_checks(chunks))
    (request,) = plan.requests
    header, part = request.parts
    assert header.byte_start == 0 and header.byte_end == part.byte_start and part.nbytes > 2 * header.nbytes
    partial = []  # the part is checked (and reported), a 16-byte block at a time
    assert execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests,
                            {part: Destination(destination, (0, 0))}, partial=partial) == request.nbytes
    assert torch.equal(destination, whole[:40])
    (reported,) = partial
    assert reported.value == zlib.crc32(data[part.byte_start:part.byte_end])


@pytest.mark.parametrize("scatter", [True, False])
def test_a_run_that_starts_past_the_header_cut_short_mid_block_names_how_far_it_got(tmp_path, monkeypatch, scatter):
    monkeypatch.setattr(read_executor, "CHECK_BLOCK_BYTES", 16)
    if not scatter:
        _no_scatter_reads(monkeypatch)
    data, chunks = _write(tmp_path)
    a = next(chunk for chunk in chunks if chunk.name == "a")
    (tmp_path / FILE).write_bytes(data[:a.byte_start + 100])
    wanted = {Target(name, kind, (0,) * WHOLE[name].dim(), tuple(WHOLE[name].shape)): torch.empty_like(WHOLE[name])
              for name, kind in [("a", "param"), ("c", "param")]}
    plan = plan_rank(index_chunks(chunks), list(wanted))  # no header check: the run starts at a, not at 0
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    assert min(request.byte_start for request in plan.requests) == a.byte_start > 0
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value).startswith(f"{tmp_path}/{FILE}: expected bytes [{a.byte_start}, {a.byte_end}) of a (param) "
                                        "but got 100 bytes; ")


@pytest.mark.parametrize("short_reads", [False, True])
def test_more_buffers_than_one_scatter_call_takes_are_read_in_further_calls(tmp_path, monkeypatch, short_reads):
    monkeypatch.setattr(read_executor, "_IOV_MAX", 2)
    if short_reads:
        _seven_bytes_a_call(monkeypatch)
    _, chunks = _write(tmp_path)
    wanted = {Target(name, kind, (0,) * WHOLE[name].dim(), tuple(WHOLE[name].shape)): torch.full_like(WHOLE[name], -1)
              for name, kind in [("a", "param"), ("b", "exp_avg"), ("c", "param"), ("d", "param")]}
    plan = plan_rank(index_chunks(chunks), list(wanted))
    (request,) = plan.requests  # four buffers back to back, read in one batch of 1 MiB blocks
    assert len(request.parts) == 4
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    assert execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item) == request.nbytes
    for target, tensor in wanted.items():
        assert torch.equal(_bits(tensor), _bits(WHOLE[target.name])), target


def _expected_of(wholes, target):
    region = tuple(slice(o, o + s) for o, s in zip(target.offsets, target.sizes))
    return wholes[target.name][region] if region else wholes[target.name]


def test_unchecked_parts_between_checked_blocks_are_read_and_counted_once(tmp_path, monkeypatch):
    """p read whole (checked, 8 bytes: half a block), q's two row halves read for two targets
    (parts of a chunk, unchecked when nobody collects them), then w read whole (checked): one
    run, where the 16-byte blocks fill only after the unchecked bytes."""
    monkeypatch.setattr(read_executor, "CHECK_BLOCK_BYTES", 16)
    whole = {"p": _asymmetric((2,), torch.float32, 14), "q": _asymmetric((4, 4), torch.float32, 15),
             "w": _asymmetric((3, 4), torch.float32, 16)}
    data, chunks = encode_shard([Piece(name, "param", value, tuple(value.shape), (0,) * value.dim())
                                 for name, value in whole.items()], FILE)
    (tmp_path / "attempt-x").mkdir()
    (tmp_path / FILE).write_bytes(data)
    wanted = {Target("p", "param", (0,), (2,)): torch.full((2,), -1.0),
              Target("q", "param", (0, 0), (2, 4)): torch.full((2, 4), -1.0),
              Target("q", "param", (2, 0), (2, 4)): torch.full((2, 4), -1.0),
              Target("w", "param", (0, 0), (3, 4)): torch.full((3, 4), -1.0)}
    plan = plan_rank(index_chunks(chunks), list(wanted))
    (request,) = plan.requests
    assert [(part.chunk.name, part.nbytes) for part in request.parts] == [("p", 8), ("q", 32), ("q", 32), ("w", 48)]
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    _never_staged(monkeypatch)
    assert execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item) == 120
    for target, tensor in wanted.items():
        assert torch.equal(tensor, _expected_of(whole, target)), target


def test_tiny_parts_back_to_back_land_when_each_call_fills_only_one_buffer(tmp_path, monkeypatch):
    """4-, 3- and 20-byte chunks read in one scatter read, each call returning at most 7 bytes into
    its first buffer: every short call moves on past the buffers it filled, and only those."""
    _seven_bytes_a_call(monkeypatch)
    whole = {"x": torch.tensor(-2.75), "y": torch.tensor([5, -7, 9], dtype=torch.int8),
             "z": _asymmetric((5,), torch.float32, 13)}
    data, chunks = encode_shard([Piece(name, "param", value, tuple(value.shape), (0,) * value.dim())
                                 for name, value in whole.items()], FILE)
    (tmp_path / "attempt-x").mkdir()
    (tmp_path / FILE).write_bytes(data)
    wanted = {Target(name, "param", (0,) * value.dim(), tuple(value.shape)): torch.full_like(value, -1)
              for name, value in whole.items()}
    plan = plan_rank(index_chunks(chunks), list(wanted))
    (request,) = plan.requests
    assert [part.nbytes for part in request.parts] == [4, 3, 20]
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    _never_staged(monkeypatch)
    assert execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item) == 27
    for target, tensor in wanted.items():
        assert torch.equal(tensor, whole[target.name]), target


@pytest.mark.parametrize("dtype, destination, block_reads", [
    # f (4 rows of 12 bytes) into a transposed destination, 16-byte blocks: one row a read.
    ("float32", lambda: torch.full((3, 4), -1.0).t(), [12, 12, 12, 12]),
    # 40 one-byte rows into a strided destination: 16 rows a read.
    ("uint8", lambda: torch.zeros(80, dtype=torch.uint8)[::2], [16, 16, 8]),
    # A destination off the CPU (a meta tensor stands in for a device) takes STAGE_BYTES blocks: one read.
    ("float32-meta", lambda: torch.empty((4, 3), device="meta"), [48]),
    # A 0-d part is one row, read whole even when the block is smaller than it.
    ("0d-meta", lambda: torch.empty((), device="meta"), [4]),
])
def test_a_staged_part_is_read_a_block_of_whole_rows_at_a_time(tmp_path, monkeypatch, dtype, destination, block_reads):
    monkeypatch.setattr(read_executor, "CHECK_BLOCK_BYTES", 16)
    if dtype == "0d-meta":
        monkeypatch.setattr(read_executor, "STAGE_BYTES", 2)
    if dtype == "uint8":
        value = torch.arange(40, dtype=torch.uint8) * 3
        data, chunks = encode_shard([Piece("u", "param", value, (40,), (0,))], FILE)
        (tmp_path / "attempt-x").mkdir()
        (tmp_path / FILE).write_bytes(data)
        target = Target("u", "param", (0,), (40,))
    elif dtype == "0d-meta":
        value = WHOLE["d"]
        data, chunks = _write(tmp_path)
        target = Target("d", "param", (), ())
    else:
        value = WHOLE["f"]
        data, chunks = _write(tmp_path)
        target = Target("f", "param", (0, 0), (4, 3))
    plan = plan_rank(index_chunks(chunks), [target])
    (item,) = plan.items[target]
    tensor = destination()
    assert read_executor._direct_buffer(item, Destination(tensor, target.offsets)) is None
    reads = _spy_reads(monkeypatch)
    assert execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests,
                            {item: Destination(tensor, target.offsets)}) == item.nbytes
    assert reads == [(item.byte_start + sum(block_reads[:n]), size) for n, size in enumerate(block_reads)]
    if tensor.device.type == "cpu":
        assert torch.equal(tensor, value)


def test_a_0d_part_for_a_destination_of_another_dtype_is_refused_not_filled_with_raw_bytes(tmp_path):
    _, chunks = _write(tmp_path)
    target = Target("d", "param", (), ())
    plan = plan_rank(index_chunks(chunks), [target])
    destination = torch.tensor(-1, dtype=torch.int32)  # as many bytes as d's float32
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests,
                         {item: Destination(destination, ()) for item in plan.items[target]})
    assert str(failed.value).startswith(f"{tmp_path}/{FILE}: d (param) is stored as float32, the model expects int32. Fix: ")
    assert destination.item() == -1
