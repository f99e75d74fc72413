"""Every byte a load reads is verified, on every read path: here the object-store path of the read
executor (whole requests, and parts bigger than the fetch window read in row blocks), through an
fsspec memory filesystem, and the checksum functions against zlib's and crc32c's published values.
(The local path: tests/unit/test_local_read_runs.py.)"""
import re
import uuid
import zlib
from dataclasses import replace

import fsspec
import pytest
import torch

from rayshard.storage import checksums
from rayshard.storage.checksums import algorithm_of, checksum, combine, matches, running_like
from rayshard.actors.checkpoint.read_executor import Destination, execute_requests, fill_from_reads
from rayshard.actors.checkpoint.shard_writer import Piece, encode_shard
from rayshard.plans.checkpoint.reshard import Target, coalesce, header_checks, index_chunks, plan_rank
from rayshard.plans.errors import CheckpointError

FILE = "attempt-x/rank-00000.safetensors"
# Whole requests; parts bigger than the window, read in row blocks of 2 rows (a: 40 bytes a row).
WINDOWS = [2**20, 96]


def _values(shape, salt):
    count = torch.Size(shape).numel()
    return (torch.arange(count, dtype=torch.float64) * (7 + salt) % 101 - 50 + salt / 8).reshape(shape).float()


WHOLE = {"a": _values((6, 10), 1), "b": _values((5,), 2), "e": _values((8, 4), 3)}


def _store():
    """The shard in a fresh memory:// store: (filesystem, base, file bytes, chunks)."""
    pieces = [Piece("a", "param", WHOLE["a"], (6, 10), (0, 0)), Piece("b", "param", WHOLE["b"], (5,), (0,)),
              Piece("e", "param", WHOLE["e"], (8, 4), (0, 0))]
    data, chunks = encode_shard(pieces, FILE)
    fs, base = fsspec.core.url_to_fs(f"memory://verify-{uuid.uuid4().hex}")
    fs.pipe_file(f"{base}/{FILE}", data)
    return fs, base, data, chunks


def _plan(chunks):
    """a and b read whole; e read in part (rows 2..6), so its header is checked and the part reported."""
    wanted = {Target("a", "param", (0, 0), (6, 10)): torch.full((6, 10), -1.0),
              Target("b", "param", (0,), (5,)): torch.full((5,), -1.0),
              Target("e", "param", (2, 0), (4, 4)): torch.full((4, 4), -1.0)}
    plan = plan_rank(index_chunks(chunks), list(wanted), headers=header_checks(chunks), min_segment_bytes=1 << 20)
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    return plan, wanted, by_item


def _damaged(fs, base, data, at):
    changed = bytearray(data)
    changed[at] ^= 0x10
    fs.pipe_file(f"{base}/{FILE}", bytes(changed))


@pytest.mark.parametrize("window", WINDOWS)
def test_an_object_store_read_lands_bit_for_bit_and_reports_each_part(window):
    fs, base, data, chunks = _store()
    plan, wanted, by_item = _plan(chunks)
    served, partial = [], []
    read = execute_requests(fs, base, plan.requests, by_item, window_bytes=window, served=served.append, partial=partial)
    for target, tensor in wanted.items():
        region = tuple(slice(o, o + s) for o, s in zip(target.offsets, target.sizes))
        assert torch.equal(tensor, WHOLE[target.name][region]), target
    assert sorted(map(id, served)) == sorted(map(id, by_item))
    assert read == sum(part.nbytes for request in plan.requests for part in request.parts)
    # The one part of a chunk: its checksum is zlib's CRC32 of exactly the bytes it read.
    (part,) = partial
    e = next(c for c in chunks if c.name == "e")
    assert (part.name, part.chunk_start, part.chunk_end, part.recorded) == ("e", e.byte_start, e.byte_end, e.checksum)
    assert part.end - part.start == 4 * 4 * 4 and e.byte_start <= part.start < part.end <= e.byte_end
    assert part.value == zlib.crc32(data[part.start:part.end])


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("victim, row", [("a", 0), ("a", 5), ("b", 0)])
def test_a_changed_byte_in_a_whole_chunk_from_an_object_store_names_the_tensor(window, victim, row):
    fs, base, data, chunks = _store()
    chunk = next(c for c in chunks if c.name == victim)
    row_bytes = (chunk.byte_end - chunk.byte_start) // (chunk.sizes[0] if victim == "a" else 1)
    _damaged(fs, base, data, chunk.byte_start + row * row_bytes + 3)
    plan, wanted, by_item = _plan(chunks)
    with pytest.raises(CheckpointError, match=rf"^{base}/{FILE}: checksum mismatch for {victim} \(param\) at bytes "
                                              rf"\[{chunk.byte_start}, {chunk.byte_end}\); the file changed or is corrupt\. Fix: restore it from a "
                                              r"copy, or resume from another checkpoint$"):
        execute_requests(fs, base, plan.requests, by_item, window_bytes=window)


@pytest.mark.parametrize("window", WINDOWS)
def test_a_changed_byte_in_a_part_changes_its_reported_checksum_not_the_load(window):
    fs, base, data, chunks = _store()
    e = next(c for c in chunks if c.name == "e")
    _damaged(fs, base, data, e.byte_start + 3 * 16 + 1)  # row 3 of e, inside the part read
    plan, _, by_item = _plan(chunks)
    partial = []
    execute_requests(fs, base, plan.requests, by_item, window_bytes=window, partial=partial)
    (part,) = partial
    assert part.value != zlib.crc32(data[part.start:part.end])  # the driver's combine then fails the chunk


@pytest.mark.parametrize("window", WINDOWS)
def test_a_changed_header_from_an_object_store_is_caught(window):
    fs, base, data, chunks = _store()
    _damaged(fs, base, data, 9)
    plan, _, by_item = _plan(chunks)
    with pytest.raises(CheckpointError, match=rf"^{base}/{FILE}: its safetensors header differs from the one recorded "
                                              r"in the manifest"):
        execute_requests(fs, base, plan.requests, by_item, window_bytes=window)


@pytest.mark.parametrize("window", WINDOWS)
def test_a_short_object_names_the_bytes_it_could_not_supply(window):
    fs, base, data, chunks = _store()
    b = next(c for c in chunks if c.name == "b")
    fs.pipe_file(f"{base}/{FILE}", data[:b.byte_start + 2])
    plan, _, by_item = _plan(chunks)
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fs, base, plan.requests, by_item, window_bytes=window)
    named = re.fullmatch(rf"{base}/{FILE}: expected bytes \[(\d+), (\d+)\) of (.+) but got (\d+) bytes; the shard is "
                         r"missing or truncated\. Fix: restore the file, or resume from an earlier checkpoint", str(failed.value))
    assert named, failed.value
    start, end, what, got = int(named[1]), int(named[2]), named[3], int(named[4])
    cut = b.byte_start + 2
    assert start < end and end > cut and got == max(0, cut - start), failed.value  # the range the cut file lacks
    assert all(f"{c.name} (param)" in what for c in chunks if start <= c.byte_start < end), what


# --- the checksum functions ---------------------------------------------------------------------

CHECK = b"123456789"  # the CRC catalogue's check input: CRC-32 cbf43926, CRC-32C e3069283


def test_checksums_are_the_catalogue_values_and_print_as_eight_hex_digits():
    assert checksum(CHECK) == "crc32:cbf43926" == f"crc32:{zlib.crc32(CHECK):08x}"
    assert checksum(CHECK, "crc32c") == "crc32c:e3069283"
    assert checksum(b"\x00" * 0) == "crc32:00000000"
    assert checksum(b"a") == "crc32:e8b7be43"


@pytest.mark.parametrize("algorithm", ["crc32", "crc32c"])
@pytest.mark.parametrize("fast", [True, False])
def test_combining_parts_gives_the_whole(monkeypatch, algorithm, fast):
    if not fast:
        monkeypatch.setattr(checksums, "_crc32_combine", None)  # the pure-Python polynomial path
    data = bytes(range(256)) * 5 + b"tail"
    for cut in (0, 1, 7, 640, len(data) - 1, len(data)):
        first, second = running_like(f"{algorithm}:0"), running_like(f"{algorithm}:0")
        first.update(data[:cut])
        second.update(data[cut:])
        assert f"{algorithm}:{combine(algorithm, first.value, second.value, len(data) - cut):08x}" == checksum(data, algorithm)


def test_matches_reads_the_algorithm_from_the_recorded_value_and_takes_buffers_in_order():
    assert matches("crc32c:e3069283", [b"1234", b"56789"])
    assert matches("crc32:cbf43926", [memoryview(b"12345"), b"6789"])
    assert not matches("crc32:cbf43926", [b"56789", b"1234"])
    assert not matches("crc32c:cbf43926", [CHECK])


def test_an_unknown_algorithm_is_named_with_the_ones_we_know():
    assert algorithm_of("crc32c:00000000") == "crc32c" and algorithm_of("crc32:1") == "crc32"
    with pytest.raises(CheckpointError, match=r"^shard.safetensors: checksum 'sha1:abc' uses 'sha1', which this rayshard "
                                              r"cannot verify \(it knows crc32, crc32c\); upgrade rayshard to read it$"):
        running_like("sha1:abc", "shard.safetensors")


UNKNOWN = "which this rayshard cannot verify (it knows crc32, crc32c); upgrade rayshard to read it"


def test_an_unknown_algorithm_is_blamed_on_the_manifest_unless_told_where_and_named_before_its_first_colon():
    for check in (lambda: algorithm_of("md5:ab:cd"), lambda: running_like("md5:ab:cd"),
                  lambda: matches("md5:ab:cd", [b"x"])):
        with pytest.raises(CheckpointError) as error:
            check()
        assert str(error.value) == f"manifest: checksum 'md5:ab:cd' uses 'md5', {UNKNOWN}"
    with pytest.raises(CheckpointError) as error:
        matches("md5:00", [b"x"], "rank-00001.safetensors")
    assert str(error.value) == f"rank-00001.safetensors: checksum 'md5:00' uses 'md5', {UNKNOWN}"


# --- the object-store path's failures, message by message -----------------------------------------

SHORT_FIX = "the shard is missing or truncated. Fix: restore the file, or resume from an earlier checkpoint"


def _whole_items(chunks, names):
    """Each named chunk read whole into a fresh tensor: (items, destinations by item)."""
    wanted = {Target(c.name, "param", (0,) * len(c.global_shape), tuple(c.global_shape)): torch.full(c.global_shape, -1.0)
              for c in chunks if c.name in names}
    plan = plan_rank(index_chunks(chunks), list(wanted))
    items = [item for target, found in plan.items.items() for item in found]
    return items, {item: Destination(wanted[target], target.offsets) for target, found in plan.items.items() for item in found}


def test_a_part_bigger_than_the_window_cut_short_names_the_row_block_it_lacks():
    fs, base, data, chunks = _store()
    a = next(c for c in chunks if c.name == "a")  # 6 rows of 40 bytes: a 96-byte window reads 2 rows a time
    fs.pipe_file(f"{base}/{FILE}", data[:a.byte_start + 100])  # rows 2-3 ([80, 160) of a) come back 20 bytes short
    items, by_item = _whole_items(chunks, {"a"})
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fs, base, coalesce(items), by_item, window_bytes=96)
    assert str(failed.value) == (f"{base}/{FILE}: expected bytes [{a.byte_start + 80}, {a.byte_start + 160}) of a (param) "
                                 f"but got 20 bytes; {SHORT_FIX}")


def test_a_missing_object_names_the_error_the_store_gave():
    fs, base, data, chunks = _store()
    a = next(c for c in chunks if c.name == "a")
    fs.rm(f"{base}/{FILE}")
    items, by_item = _whole_items(chunks, {"a"})
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fs, base, coalesce(items), by_item, window_bytes=96)
    assert re.fullmatch(rf"{base}/{FILE}: expected bytes \[{a.byte_start}, {a.byte_start + 80}\) of a \(param\) but got "
                        rf"an error: .*{FILE}.*; {re.escape(SHORT_FIX)}", str(failed.value)), failed.value


def test_a_small_part_of_a_request_bigger_than_the_window_is_read_whole_and_named_when_short():
    fs, base, data, chunks = _store()
    b = next(c for c in chunks if c.name == "b")
    fs.pipe_file(f"{base}/{FILE}", data[:b.byte_start + 2])
    items, by_item = _whole_items(chunks, {"a", "b"})
    (request,) = coalesce(items)  # a (240 bytes, row blocks) and b (20 bytes, read whole) in one request
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fs, base, [request], by_item, window_bytes=96)
    assert str(failed.value) == f"{base}/{FILE}: expected bytes [{b.byte_start}, {b.byte_end}) of b (param) but got 2 bytes; {SHORT_FIX}"


@pytest.mark.parametrize("window", WINDOWS)
def test_a_chunk_whose_checksum_algorithm_is_unknown_is_refused_naming_the_file(window):
    fs, base, data, chunks = _store()
    chunks = [replace(c, checksum="md5:0") if c.name == "a" else c for c in chunks]
    items, by_item = _whole_items(chunks, {"a"})
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fs, base, coalesce(items, window), by_item, window_bytes=window)
    assert str(failed.value) == f"{base}/{FILE}: checksum 'md5:0' uses 'md5', {UNKNOWN}"


def test_fill_from_reads_streams_through_the_window_and_reports_parts():
    fs, base, data, chunks = _store()
    e = next(c for c in chunks if c.name == "e")
    items = plan_rank(index_chunks(chunks), [Target("e", "param", (2, 0), (4, 4))]).items
    (found,) = items.values()
    target, partial = torch.full((4, 4), -1.0), []
    assert fill_from_reads(fs, base, found, target, (2, 0), window_bytes=32, partial=partial) == 64
    assert torch.equal(target, WHOLE["e"][2:6])
    (part,) = partial  # rows 2..6 of e: 64 bytes, a part of its chunk, its CRC32 reported for the driver to combine
    assert (part.name, part.end - part.start, part.value) == ("e", 64, zlib.crc32(data[part.start:part.end]))
    assert part.start == e.byte_start + 2 * 16


def test_no_object_store_fetch_is_bigger_than_the_window(monkeypatch):
    """A part bigger than the window (a: 240 bytes) is fetched a block of whole rows at a time."""
    fs, base, data, chunks = _store()
    fetched = []
    cat_file, cat_ranges = fs.cat_file, fs.cat_ranges

    def recording_cat_file(path, start=None, end=None, **kwargs):
        fetched.append(end - start)
        return cat_file(path, start=start, end=end, **kwargs)

    def recording_cat_ranges(paths, starts, ends, **kwargs):
        fetched.extend(end - start for start, end in zip(starts, ends))
        return cat_ranges(paths, starts, ends, **kwargs)

    monkeypatch.setattr(fs, "cat_file", recording_cat_file)
    monkeypatch.setattr(fs, "cat_ranges", recording_cat_ranges)
    items, by_item = _whole_items(chunks, {"a", "b", "e"})
    assert execute_requests(fs, base, coalesce(items), by_item, window_bytes=96) == sum(item.nbytes for item in items)
    for item, destination in by_item.items():
        assert torch.equal(destination.tensor, WHOLE[item.chunk.name])
    assert fetched and max(fetched) <= 96, fetched
    assert sum(fetched) == sum(item.nbytes for item in items)  # and nothing twice


def _record_fetches(monkeypatch, fs):
    """The size of every range the store is asked for, in order (a range fetched through
    cat_ranges counted once, not again by the cat_file it calls)."""
    fetched, inside = [], []
    cat_file, cat_ranges = fs.cat_file, fs.cat_ranges

    def recording_cat_file(path, start=None, end=None, **kwargs):
        if not inside:
            fetched.append(end - start)
        return cat_file(path, start=start, end=end, **kwargs)

    def recording_cat_ranges(paths, starts, ends, **kwargs):
        fetched.extend(end - start for start, end in zip(starts, ends))
        inside.append(True)
        try:
            return cat_ranges(paths, starts, ends, **kwargs)
        finally:
            inside.pop()

    monkeypatch.setattr(fs, "cat_file", recording_cat_file)
    monkeypatch.setattr(fs, "cat_ranges", recording_cat_ranges)
    return fetched


def _store_of(values: dict):
    """A shard of whole tensors in a fresh memory:// store: (filesystem, base, file bytes, chunks)."""
    pieces = [Piece(name, "param", value, tuple(value.shape), (0,) * value.dim()) for name, value in values.items()]
    data, chunks = encode_shard(pieces, FILE)
    fs, base = fsspec.core.url_to_fs(f"memory://verify-{uuid.uuid4().hex}")
    fs.pipe_file(f"{base}/{FILE}", data)
    return fs, base, data, chunks


@pytest.mark.parametrize("window", WINDOWS)
def test_a_0d_tensor_and_a_1d_one_bigger_than_the_window_land_from_an_object_store(monkeypatch, window):
    """A 0-d tensor is fetched whole; a 1-D one of 40 elements (160 bytes) a block of elements
    at a time when it is bigger than the window, never in one fetch bigger than the window."""
    values = {"s": torch.tensor(-3.25), "v": _values((40,), 4)}
    fs, base, _, chunks = _store_of(values)
    wanted = {Target(name, "param", (0,) * value.dim(), tuple(value.shape)): torch.full_like(value, -1.0)
              for name, value in values.items()}
    plan = plan_rank(index_chunks(chunks), list(wanted))
    by_item = {item: Destination(wanted[target], target.offsets) for target, items in plan.items.items() for item in items}
    fetched = _record_fetches(monkeypatch, fs)
    assert execute_requests(fs, base, coalesce(by_item, window), by_item, window_bytes=window) == 4 + 160
    for target, tensor in wanted.items():
        assert torch.equal(tensor, values[target.name]), target
    assert max(fetched) <= window and sum(fetched) == 4 + 160, fetched
    if window == 96:
        assert sorted(fetched) == [4, 64, 96]  # 24 elements, then the other 16


@pytest.mark.parametrize("window", [96, 20])  # b is 20 bytes: a part the window's size is read whole too
def test_a_damaged_chunk_read_whole_is_refused_before_any_of_it_is_copied(window):
    fs, base, data, chunks = _store()
    b = next(c for c in chunks if c.name == "b")
    _damaged(fs, base, data, b.byte_start + 5)
    items, by_item = _whole_items(chunks, {"a", "b"})
    (request,) = coalesce(items)  # a (240 bytes, read in row blocks) and b (read whole) in one request
    assert request.nbytes > window >= b.byte_end - b.byte_start == 20
    with pytest.raises(CheckpointError, match=rf"^{base}/{FILE}: checksum mismatch for b \(param\) at bytes "
                                              rf"\[{b.byte_start}, {b.byte_end}\)"):
        execute_requests(fs, base, [request], by_item, window_bytes=window)
    (destination,) = [d.tensor for item, d in by_item.items() if item.chunk.name == "b"]
    assert torch.equal(destination, torch.full((5,), -1.0))


def test_a_request_exactly_the_window_is_fetched_and_placed_once():
    fs, base, _, chunks = _store()
    items, by_item = _whole_items(chunks, {"a"})
    (request,) = coalesce(items)
    served = []
    assert execute_requests(fs, base, [request], by_item, window_bytes=request.nbytes, served=served.append) == 240
    assert served == list(items)
    (destination,) = [d.tensor for d in by_item.values()]
    assert torch.equal(destination, WHOLE["a"])


def test_fill_from_reads_merges_neighbouring_items_up_to_the_window_and_no_further(monkeypatch):
    """Four 16-byte chunks of one tensor, stored back to back: a 32-byte window fetches them as two
    32-byte ranges; an 80-byte part of one chunk, a 32-byte window fetches in blocks of 2 rows."""
    whole = _values((8, 2), 5)
    pieces = [Piece("r", "param", whole[row:row + 2].contiguous(), (8, 2), (row, 0)) for row in range(0, 8, 2)]
    pieces.append(Piece("t", "param", _values((6, 4), 6), (6, 4), (0, 0)))
    data, chunks = encode_shard(pieces, FILE)
    fs, base = fsspec.core.url_to_fs(f"memory://verify-{uuid.uuid4().hex}")
    fs.pipe_file(f"{base}/{FILE}", data)
    fetched = _record_fetches(monkeypatch, fs)
    (found,) = plan_rank(index_chunks(chunks), [Target("r", "param", (0, 0), (8, 2))]).items.values()
    assert [item.nbytes for item in found] == [16] * 4
    target = torch.full((8, 2), -1.0)
    assert fill_from_reads(fs, base, found, target, (0, 0), window_bytes=32) == 64
    assert torch.equal(target, whole) and fetched == [32, 32]
    fetched.clear()
    (found,) = plan_rank(index_chunks(chunks), [Target("t", "param", (1, 0), (5, 4))]).items.values()
    target = torch.full((5, 4), -1.0)
    assert fill_from_reads(fs, base, found, target, (1, 0), window_bytes=32) == 80
    assert torch.equal(target, _values((6, 4), 6)[1:]) and fetched == [32, 32, 16]


def test_an_object_store_load_warns_about_nothing():
    """Fetched bytes are read-only; torch warns about that (here every time, not once a process),
    and the executor, which only copies them out, keeps the warning to itself."""
    import warnings

    fs, base, data, chunks = _store()
    plan, wanted, by_item = _plan(chunks)
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            execute_requests(fs, base, plan.requests, by_item)
    finally:
        torch.set_warn_always(False)
    for target, tensor in wanted.items():
        region = tuple(slice(o, o + s) for o, s in zip(target.offsets, target.sizes))
        assert torch.equal(tensor, WHOLE[target.name][region]), target


@pytest.mark.parametrize("names, named", [({"a", "b", "e"}, "a (param), b (param), e (param)"),
                                          ({"a", "b"}, "a (param), b (param)")])
def test_a_short_request_of_up_to_three_tensors_names_them_all(names, named):
    fs, base, data, chunks = _store()
    items, by_item = _whole_items(chunks, names)
    (request,) = coalesce(items)
    fs.pipe_file(f"{base}/{FILE}", data[:request.byte_end - 1])
    with pytest.raises(CheckpointError) as failed:
        execute_requests(fs, base, [request], by_item)
    assert str(failed.value) == (f"{base}/{FILE}: expected bytes [{request.byte_start}, {request.byte_end}) of {named} "
                                 f"but got {request.nbytes - 1} bytes; {SHORT_FIX}")
