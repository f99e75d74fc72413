"""Local loads read back-to-back parts in one scatter read and check each whole chunk block by
block as it lands (`actors/checkpoint/read_executor._execute_local`). These cases put every kind of part in
one file and one plan: parts read straight into contiguous destinations, column chunks staged
into rows of wider ones, whole rows staged for a narrow column range, a non-contiguous
destination, bfloat16, int64, a 0-d tensor, header checks, and parts that overlap (two targets
reading the same rows), so one request is cut into several runs."""
import os
from dataclasses import replace

import fsspec
import pytest
import torch
from hypothesis import given, settings, strategies as st

from actors.checkpoint import read_executor
from actors.checkpoint.read_executor import Destination, execute_requests
from actors.checkpoint.shard_writer import Piece, encode_shard
from plans.errors import CheckpointError
from plans.checkpoint.reshard import Target, coalesce, header_checks, index_chunks, plan_rank

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
    changed = bytearray(data)
    changed[(chunk.byte_start + chunk.byte_end) // 2] ^= 0x04
    (tmp_path / FILE).write_bytes(bytes(changed))
    plan, _, by_item = _plan_and_destinations(chunks)
    with pytest.raises(CheckpointError, match=rf"checksum mismatch for {victim} \(param\) at bytes \[{chunk.byte_start}, "):
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)


def test_a_changed_header_is_caught_when_a_chunk_is_read_only_in_part(tmp_path):
    data, chunks = _write(tmp_path)
    changed = bytearray(data)
    changed[9] ^= 0x01  # inside the JSON header; e is read only in part, so its header is checked
    (tmp_path / FILE).write_bytes(bytes(changed))
    plan, _, by_item = _plan_and_destinations(chunks)
    with pytest.raises(CheckpointError, match="safetensors header differs"):
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)


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
    assert str(failed.value) == "a (param): stored as float32, model expects int32"


def test_a_local_chunk_whose_checksum_algorithm_is_unknown_is_refused_naming_the_file(tmp_path):
    _, chunks = _write(tmp_path)
    chunks = [replace(c, checksum="md5:0") if c.name == "a" else c for c in chunks]
    plan = plan_rank(index_chunks(chunks), [Target("a", "param", (0, 0), (6, 10))])
    by_item = {item: Destination(torch.empty(6, 10), (0, 0)) for items in plan.items.values() for item in items}
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fsspec.filesystem("file"), str(tmp_path), plan.requests, by_item)
    assert str(failed.value).startswith(f"{tmp_path}/{FILE}: checksum 'md5:0' uses 'md5', which this rayshard cannot verify")
