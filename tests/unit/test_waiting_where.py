"""Where a rank's blocked call waits (actors/waiting_where.py): the innermost frame and the
innermost one in rayshard's own code, asked from another thread, as the rank pool asks a rank
that did not answer (cluster/run/rank_pool.py) before it kills it."""
import threading
import time
from types import SimpleNamespace

from rayshard.actors.rank import leaves_its_group_on_failure
from rayshard.actors.waiting_where import where_thread_is


def test_a_blocked_call_is_named_with_its_innermost_frame_and_our_own():
    release = threading.Event()
    rank = SimpleNamespace(trainer=None, running=None)

    @leaves_its_group_on_failure
    def train_step(self):
        release.wait(60)
        return "done"

    worker = threading.Thread(target=train_step, args=(rank,))
    worker.start()
    try:
        deadline = time.monotonic() + 10
        while rank.running is None and time.monotonic() < deadline:
            time.sleep(0.01)
        name, thread, _since = rank.running
        assert name == "train_step" and thread == worker.ident
        time.sleep(0.05)  # into the wait
        line = where_thread_is(thread)
        assert line.startswith("wait (") and "threading.py:" in line, line
        assert " from guarded (actors/rank.py:" in line, line  # the decorator is the innermost of ours
    finally:
        release.set()
        worker.join(10)
    assert rank.running is None  # cleared once the call returned
    assert where_thread_is(worker.ident) == ""  # an ended thread


def test_a_failed_call_clears_what_it_ran():
    rank = SimpleNamespace(trainer=None, running=None)

    @leaves_its_group_on_failure
    def load(self):
        raise ValueError("a peer left")

    try:
        load(rank)
    except ValueError:
        pass
    assert rank.running is None
