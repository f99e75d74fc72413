"""Which replica writes a piece held by several ranks: literal expectations worked out by hand from
the rule (largest piece first onto the least-loaded member, ties to the member that comes first
after the group's rotation), not computed by calling the rule again.

The rotation of a group is crc32(salt) % size (zlib's CRC, asserted below for the salts used):
member m's place in the tie order is (m - rotation) % size."""
import zlib

import pytest

from rayshard.plans.checkpoint.regions import Region
from rayshard.plans.checkpoint.replicas import (assign_readers, assign_writers, file_position, group_salt, handover_dims,
                                       pieces_written, read_once_readers, read_once_readers_by_copies, replica_members,
                                       replica_rank)
from rayshard.plans.layout.parallel_layout import ParallelLayout


def test_the_salts_used_below_rotate_as_stated():
    assert [zlib.crc32(s.encode()) % 2 for s in ("d", "a")] == [0, 1]
    assert zlib.crc32(b"b") % 3 == 2


@pytest.mark.parametrize("salt, expected", [
    # sorted largest first: 50 (piece 1), 30 (2), 20 (3), 10 (0)
    ("d", [0, 0, 1, 1]),  # rotation 0: 50 -> m0; 30 -> m1; 20 -> m1 (30 < 50); 10 -> tie at 50, m0 first
    ("a", [1, 1, 0, 0]),  # rotation 1: 50 -> m1; 30 -> m0; 20 -> m0; 10 -> tie at 50, m1 first
])
def test_largest_first_onto_the_least_loaded_member_from_the_groups_rotation(salt, expected):
    assert assign_writers([10, 50, 30, 20], 2, salt) == expected


def test_equal_pieces_go_round_the_group_starting_at_its_rotation():
    # Size 3, rotation 2: tie order m2, m0, m1; equal pieces in listed order.
    assert assign_writers([5] * 7, 3, "b") == [2, 0, 1, 2, 0, 1, 2]


def test_a_group_of_one_writes_everything():
    assert assign_writers([3, 1, 2], 1, "a") == [0, 0, 0]


def test_replica_members_and_ranks_of_a_dp2_tp2_layout():
    layout = ParallelLayout(dp=2, tp=2)  # ranks: 0 (dp0 tp0), 1 (dp0 tp1), 2 (dp1 tp0), 3 (dp1 tp1)
    coords = [layout.coords_of(rank) for rank in range(4)]
    assert [replica_members(layout, c, ("dp",)) for c in coords] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [replica_members(layout, c, ("dp", "tp")) for c in coords] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [replica_members(layout, c, ("tp",)) for c in coords] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [replica_rank(layout, coords[1], ("dp",), m) for m in (0, 1)] == [1, 3]
    assert [replica_rank(layout, coords[0], ("dp", "tp"), m) for m in range(4)] == [0, 1, 2, 3]
    # Salts name the group: the dp group of tp rank 1 is not the dp group of tp rank 0.
    assert group_salt(("dp",), coords[1]) == group_salt(("dp",), coords[3]) == "dp|pp0,dp0,fsdp0,tp1"
    assert group_salt(("dp", "tp"), coords[3]) == "dp,tp|pp0,dp0,fsdp0,tp0"


# Pieces every rank of a dp2 x tp2 layout lists (each replica group lists its pieces in the same
# order): copy dims and bytes. Rotations: both dp groups' salts give 1 (of 2), the dp x tp
# group's gives 2 (of 4).
COPIES = [(), ("dp",), ("dp",), ("dp", "tp"), ("dp", "tp"), ("dp",)]
BYTES = [100, 40, 60, 8, 8, 50]


def test_pieces_written_on_dp2_tp2_by_hand():
    layout = ParallelLayout(dp=2, tp=2)
    assert zlib.crc32(b"dp|pp0,dp0,fsdp0,tp0") % 2 == zlib.crc32(b"dp|pp0,dp0,fsdp0,tp1") % 2 == 1
    assert zlib.crc32(b"dp,tp|pp0,dp0,fsdp0,tp0") % 4 == 2
    # dp groups: 60 (piece 2) -> member 1 (rotation 1 goes first); 50 (5) -> member 0; 40 (1) -> member 0.
    # dp x tp group (order m2, m3, m0, m1): 8 (3) -> member 2 = rank 2; 8 (4) -> member 3 = rank 3.
    # Piece 0 only its own rank holds. In the file: own pieces, then dp copies, then dp x tp copies.
    expected = {0: [0, 1, 5], 1: [0, 1, 5], 2: [0, 2, 3], 3: [0, 2, 4]}
    assert {rank: pieces_written(COPIES, BYTES, layout, layout.coords_of(rank)) for rank in range(4)} == expected


def test_read_once_readers_follow_the_writers():
    """On a resume onto the layout that saved, each replica group's reader of a piece is its writer."""
    layout = ParallelLayout(dp=2, tp=2)
    copies = [("dp",), ("dp",), ("dp", "tp"), ("dp", "tp"), ("dp",)]
    sizes = [40, 60, 8, 8, 50]
    # global ranks: tp rank 0's dp group is {0, 2}, tp rank 1's is {1, 3}
    assert assign_readers(copies, sizes, layout, layout.coords_of(0)) == [0, 2, 2, 3, 0]
    assert assign_readers(copies, sizes, layout, layout.coords_of(3)) == [1, 3, 2, 3, 1]


def test_a_writers_file_holds_its_own_pieces_then_dp_copies_then_tp_copies():
    assert [file_position(dims) for dims in [(), ("dp",), ("fsdp", "dp"), ("tp",), ("dp", "tp")]] == [0, 1, 1, 2, 2]
    # The same pieces as above listed the other way round: the file order is by position, not listing.
    layout = ParallelLayout(dp=2, tp=2)
    reversed_copies, reversed_bytes = COPIES[::-1], BYTES[::-1]  # index i here is piece 5 - i above
    # dp groups (rotation 1): 60 (3) -> member 1, 50 (0) -> member 0, 40 (4) -> member 0 (50 < 60).
    # dp x tp group (rotation 2): 8 (1) -> member 2 = rank 2, 8 (2) -> member 3 = rank 3.
    # Own piece 5 first, then dp copies in listed order, then dp x tp copies.
    expected = {0: [5, 0, 4], 1: [5, 0, 4], 2: [5, 3, 1], 3: [5, 3, 2]}
    assert {rank: pieces_written(reversed_copies, reversed_bytes, layout, layout.coords_of(rank))
            for rank in range(4)} == expected


def test_a_piece_is_handed_over_along_its_copy_dims_within_a_stage_only_when_dp_copies_it():
    assert handover_dims(("pp", "dp", "tp")) == ("dp", "tp")
    assert handover_dims(("dp",)) == ("dp",)
    assert handover_dims(("pp", "tp")) == () and handover_dims(("tp",)) == () and handover_dims(()) == ()


def _region(name, replicated_over, numel):
    return Region(name, (numel,), (0,), (numel,), replicated_over)


def test_read_once_readers_name_a_reader_only_for_pieces_dp_copies():
    layout = ParallelLayout(dp=2, tp=2)
    copies = [(), ("tp",), ("dp",), ("dp", "tp"), ("dp",)]
    sizes = [100, 30, 40, 8, 60]
    # Own and tp-only pieces: no reader named (None), each holder reads its own. The dp group of tp
    # rank 0 ({0, 2}, rotation 1): 60 -> member 1 = rank 2, 40 -> member 0 = rank 0. The dp x tp
    # group (rotation 2): its one piece -> member 2 = rank 2.
    assert read_once_readers_by_copies(copies, sizes, layout, layout.coords_of(0)) == [None, None, 0, 2, 2]
    regions = [_region(f"w{i}", dims, size // 4) for i, (dims, size) in enumerate(zip(copies, sizes))]
    assert read_once_readers(regions, sizes, layout, layout.coords_of(0)) == [None, None, 0, 2, 2]
    # Without dp replicas nothing is handed over, whatever the copy dims say.
    assert read_once_readers_by_copies(copies, sizes, ParallelLayout(tp=2), ParallelLayout(tp=2).coords_of(0)) == \
        [None] * 5
