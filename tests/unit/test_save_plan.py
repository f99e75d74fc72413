"""Who writes what in a `rayshard.checkpoint` save (plans/checkpoint/save_plan.py, decision 105):
every distinct piece once, whoever holds it, replicas sharing the writing by bytes."""
import pytest

from rayshard.plans.checkpoint.save_plan import HeldPiece, choose_writers
from rayshard.plans.errors import CheckpointError


def _piece(name, offsets=(0,), sizes=(4,), shape=(8,), kind="param", dtype="float32"):
    return HeldPiece(name, kind, dtype, shape, offsets, sizes)


def test_a_piece_held_by_several_ranks_is_written_once():
    # FSDP2 x TP's norm weight: the fsdp halves, each copied on two tp ranks (which no placement says).
    held = [[_piece("norm", (0,), (4,))], [_piece("norm", (0,), (4,))], [_piece("norm", (4,), (4,))],
            [_piece("norm", (4,), (4,))]]
    written = choose_writers(held)
    regions = [held[rank][i].offsets for rank, indices in enumerate(written) for i in indices]
    assert sorted(regions) == [(0,), (4,)]


def test_replicas_split_their_pieces_by_bytes():
    pieces = [_piece(f"w{i}", sizes=(8,), shape=(8,)) for i in range(6)]
    written = choose_writers([pieces, list(pieces)])
    assert sorted(written[0] + written[1]) == list(range(6)) and len(written[0]) == len(written[1]) == 3


def test_pieces_only_some_ranks_hold_are_written_by_them():
    # Pipeline stages: each rank holds keys the other does not; a plain tensor on both.
    held = [[_piece("stage0.w"), _piece("step", (), (), ())], [_piece("stage1.w"), _piece("step", (), (), ())]]
    written = choose_writers(held)
    names = sorted(held[rank][i].name for rank, indices in enumerate(written) for i in indices)
    assert names == ["stage0.w", "stage1.w", "step"]
    assert [held[0][i].name for i in written[0]][:1] == ["stage0.w"]


def test_ranks_disagreeing_on_a_tensor_are_refused_naming_it():
    with pytest.raises(CheckpointError, match=r"^w \(param\): rank 0 holds it as float32\[8\] but rank 1 as float32\[9\]"):
        choose_writers([[_piece("w")], [_piece("w", shape=(9,))]])
