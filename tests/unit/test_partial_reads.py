"""Chunks read in parts by several ranks are verified by combining the parts' checksums."""
import zlib

import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from rayshard.storage.checksums import combine
from rayshard.storage.partial_reads import PartialRead, check_partial_reads

FUNCTIONS = {"crc32": zlib.crc32, "crc32c": crc32c.crc32c}
DATA = bytes((i * 7919 + i // 13) % 256 for i in range(5000))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(FUNCTIONS)), st.integers(0, 5000), st.integers(0, 5000))
def test_combining_two_checksums_gives_the_checksum_of_both_parts(algorithm, cut, end):
    cut, end = min(cut, end), max(cut, end)
    crc = FUNCTIONS[algorithm]
    first, second = DATA[:cut], DATA[cut:end]
    assert combine(algorithm, crc(first), crc(second), len(second)) == crc(first + second)


def _chunk_parts(algorithm: str, cuts: list[int], data: bytes = DATA, file: str = "f", base: int = 100,
                 recorded: bytes | None = None) -> list[PartialRead]:
    """The parts [cuts[i], cuts[i+1]) of one chunk holding `data` at byte `base` of `file`."""
    crc = FUNCTIONS[algorithm]
    checksum = f"{algorithm}:{crc(recorded if recorded is not None else data):08x}"
    return [PartialRead("w", "param", file, base, base + len(data), checksum, base + low, base + high, crc(data[low:high]))
            for low, high in zip(cuts, cuts[1:])]


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(sorted(FUNCTIONS)), st.lists(st.integers(1, len(DATA) - 1), max_size=12, unique=True),
       st.randoms(use_true_random=False))
def test_parts_in_any_order_with_replicas_verify_their_chunk(algorithm, inner, rng):
    parts = _chunk_parts(algorithm, [0, *sorted(inner), len(DATA)])
    replicas = parts + rng.sample(parts, k=len(parts) // 2)  # dp replicas read the same ranges again
    rng.shuffle(replicas)
    assert check_partial_reads(replicas) == (1, [], [])


def test_a_changed_byte_in_any_part_fails_its_chunk_only():
    for algorithm in FUNCTIONS:
        changed = bytearray(DATA)
        changed[3001] ^= 0x01
        bad = _chunk_parts(algorithm, [0, 1000, 3000, 5000], bytes(changed), file="bad", recorded=DATA)
        good = _chunk_parts(algorithm, [0, 2500, 5000], file="good")
        outcome = check_partial_reads(bad + good)
        assert outcome.verified == 1 and [r.file for r in outcome.mismatched] == ["bad"] and not outcome.untiled


def test_parts_that_leave_a_gap_or_straddle_are_left_to_read_whole():
    gap = _chunk_parts("crc32", [0, 1000, 2000])[:1] + _chunk_parts("crc32", [0, 2000, 5000])[1:]
    straddling = [*_chunk_parts("crc32", [0, 3000]), *_chunk_parts("crc32", [2000, 5000])]
    for parts in (gap, straddling, _chunk_parts("crc32", [0, 4000])):
        outcome = check_partial_reads(parts)
        assert outcome.verified == 0 and not outcome.mismatched and len(outcome.untiled) == 1


def test_two_ranks_that_read_the_same_bytes_differently_fail_the_chunk():
    parts = _chunk_parts("crc32", [0, 2000, 5000])
    other = parts[1]._replace(value=parts[1].value ^ 1)
    assert check_partial_reads([*parts, other]).mismatched
