"""Bucketed replica broadcast: two gloo processes, mixed dtypes and shapes, a non-contiguous
destination and a bucket limit small enough to cut several buckets; every piece a replica did
not read arrives bit for bit."""
from __future__ import annotations

import torch
import torch.distributed as dist

from rayshard.actors.checkpoint.replica_broadcast import HandedPiece, broadcast_pieces, buckets
from tests.forked_ranks import run_ranks

READERS = [0, 0, 1, 0, 1, 1, 0, 0]


def _pieces(rank: int):
    """What each replica holds before the broadcast: its own reads filled, the rest garbage."""
    generator = torch.Generator().manual_seed(7)
    truth = [torch.randn(5, 3, generator=generator), torch.randn(17, generator=generator),
             torch.randint(-9, 9, (4, 4), generator=generator, dtype=torch.int64),
             torch.randn(2, 3, 4, generator=generator), torch.randn(33, generator=generator).to(torch.bfloat16),
             torch.randn(6, 6, generator=generator), torch.randn(1, generator=generator), torch.randn(9, 2, generator=generator)]
    held = []
    for index, (value, reader) in enumerate(zip(truth, READERS)):
        if index == 5:  # a non-contiguous destination (a transposed view of a larger buffer)
            tensor = torch.full((6, 6), -1.0).t()
        else:
            tensor = torch.full_like(value, -1)
        if reader == rank:
            tensor.copy_(value)
        held.append(tensor)
    return truth, held


def _run(rank: int, init_method: str, world_size: int, results) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        group = dist.new_group([0, 1])
        truth, held = _pieces(rank)
        pieces = [HandedPiece(t, group) for t in held]
        received = broadcast_pieces(pieces, buckets(pieces, READERS, bucket_bytes=96), rank)
        results[rank] = (all(torch.equal(a, b) for a, b in zip(truth, held)), received)
    finally:
        dist.destroy_process_group()


def test_every_piece_arrives_bit_for_bit_across_several_buckets():
    outcome = run_ranks(_run, 2)
    truth, _ = _pieces(0)
    for rank in (0, 1):
        expected = sum(t.numel() * t.element_size() for t, reader in zip(truth, READERS) if reader != rank)
        assert outcome[rank] == (True, expected)


def test_buckets_split_by_reader_dtype_and_size_and_readers_take_turns():
    group = object()
    tensors = [torch.zeros(8), torch.zeros(8), torch.zeros(8, dtype=torch.float64), torch.zeros(30), torch.zeros(4),
               torch.zeros(3)]
    cut = buckets([HandedPiece(t, group) for t in tensors], [0, 0, 0, 0, 1, 1], bucket_bytes=64)
    # Reader 0: two float32 pieces of 32 bytes share a bucket; float64 starts another; 120 bytes
    # exceed the limit alone (a piece is never split). Reader 1's pieces share one bucket, which
    # goes out second: the readers take turns, so both start handing over early.
    assert [(b.reader, b.dtype, b.members) for b in cut] == [
        (0, torch.float32, [0, 1]), (1, torch.float32, [4, 5]), (0, torch.float64, [2]), (0, torch.float32, [3])]


def test_phases_go_one_after_another_whatever_the_piece_order():
    """Pieces of a later phase (a dp x tp replica group) never go out before an earlier phase's
    (the dp group), even when they come first in the walk: ranks that share groups of both kinds
    must take them in the same order."""
    dp_group, dp_tp_group = object(), object()
    tensors = [torch.zeros(4) for _ in range(5)]
    pieces = [HandedPiece(tensors[0], dp_tp_group), HandedPiece(tensors[1], dp_group), HandedPiece(tensors[2], dp_tp_group),
              HandedPiece(tensors[3], dp_group), HandedPiece(tensors[4], dp_tp_group)]
    cut = buckets(pieces, [3, 0, 1, 2, 3], bucket_bytes=1024, phases=[1, 0, 1, 0, 1])
    assert [(b.reader, b.members) for b in cut] == [(0, [1]), (2, [3]), (1, [2]), (3, [0, 4])]


# ---- banded tensors: column slices of whole-row blocks, scattered (docs/decisions.md 146) ---------

# A 7 x 10 x 2 band over three members with uneven columns (4, 3, 3), cut into row blocks read by
# different members; one broadcast piece in the same group between them.
COLUMNS = ((0, 4), (4, 7), (7, 10))
BLOCKS = ((0, 3, 1), (3, 5, 2), (5, 7, 0))  # (first row, stop, reader)


def _run_sliced(rank: int, init_method: str, world_size: int, results) -> None:
    from rayshard.actors.checkpoint.replica_broadcast import SlicedPiece

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        group = dist.new_group([0, 1, 2])
        band = torch.randn(7, 10, 2, generator=torch.Generator().manual_seed(3))
        start, stop = COLUMNS[rank]
        local = torch.full((7, stop - start, 2), -1.0)
        norm = torch.arange(5.0) if rank == 2 else torch.zeros(5)
        pieces, readers = [HandedPiece(norm, group)], [2]
        for first, last, reader in BLOCKS:
            read = band[first:last].clone() if reader == rank else torch.empty(()).expand(last - first, 10, 2)
            pieces.append(SlicedPiece(read, group, COLUMNS, local.narrow(0, first, last - first)))
            readers.append(reader)
        received = broadcast_pieces(pieces, buckets(pieces, readers, bucket_bytes=80), rank)
        results[rank] = (torch.equal(local, band[:, start:stop]), torch.equal(norm, torch.arange(5.0)), received)
    finally:
        dist.destroy_process_group()


def test_column_slices_of_whole_row_blocks_reach_every_member_bit_for_bit():
    outcome = run_ranks(_run_sliced, 3)
    for rank in range(3):
        columns = COLUMNS[rank][1] - COLUMNS[rank][0]
        from_others = sum(last - first for first, last, reader in BLOCKS if reader != rank) * columns * 2 * 4
        assert outcome[rank] == (True, True, from_others + (0 if rank == 2 else 5 * 4)), (rank, outcome[rank])
