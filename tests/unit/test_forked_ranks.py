"""`run_ranks` never waits unboundedly: a rank still running at the deadline is killed and the
test fails naming the function and the rank (after the ranks print their stacks)."""
import time

import pytest

from tests.forked_ranks import run_ranks


def _one_rank_hangs(rank, init_method, world_size, results):
    if rank == 1:
        time.sleep(120)
    results[rank] = rank


def _both_answer(rank, init_method, world_size, results):
    results[rank] = rank * 10


def test_a_hung_rank_fails_the_test_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"_one_rank_hangs: ranks \[1\] still running after 3 s"):
        run_ranks(_one_rank_hangs, 2, deadline_s=3)
    assert time.monotonic() - start < 60  # not the 120 s the rank would sleep


def test_ranks_that_finish_return_their_answers():
    assert run_ranks(_both_answer, 2) == {0: 0, 1: 10}
