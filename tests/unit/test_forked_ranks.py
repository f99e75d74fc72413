"""`run_ranks` never waits unboundedly: a rank still running at the deadline prints its stack, is
killed and reaped, and the test fails naming the function and the rank."""
import os
import time

import pytest

from tests.forked_ranks import run_ranks


def _one_rank_hangs(rank, init_method, world_size, results, pid_dir):
    with open(os.path.join(pid_dir, str(rank)), "w") as pid_file:
        pid_file.write(str(os.getpid()))
    if rank == 1:
        time.sleep(120)


def _both_answer(rank, init_method, world_size, results):
    results[rank] = rank * 10


def test_a_hung_rank_is_killed_at_the_deadline_after_printing_its_stack(tmp_path, capfd):
    with pytest.raises(TimeoutError, match=r"_one_rank_hangs: ranks \[1\] still running after 3 s"):
        run_ranks(_one_rank_hangs, 2, str(tmp_path), deadline_s=3)
    hung = int((tmp_path / "1").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped: neither left sleeping nor a zombie
        os.kill(hung, 0)
    stderr = capfd.readouterr().err
    assert "in _one_rank_hangs" in stderr, stderr[-2000:]  # faulthandler's dump of the hung rank


def test_ranks_that_finish_return_their_answers():
    assert run_ranks(_both_answer, 2) == {0: 0, 1: 10}
