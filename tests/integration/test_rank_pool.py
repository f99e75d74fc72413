"""The elastic run's rank pool on real Ray actors (decision 149): after a failure it keeps the
actors that answer, replaces the dead and the condemned in their own bundles, and starts afresh
for another world size.

The pool reserves CPUs in a placement group, and the test session's Ray lends all of its CPUs to
the session's actor pool; so the scenario runs in a subprocess with a small Ray of its own."""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = {"CPU": 0.25}


def _scenario() -> None:
    import ray

    from rayshard.cluster.run.rank_pool import RankPool

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    lines = []
    pool = RankPool(start_timeout_s=120, log=lines.append)
    try:
        first = pool.actors_for(3, BUNDLE)
        ids = [actor._actor_id for actor in first]
        victim = ray.get(first[1].__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        os.kill(victim, signal.SIGKILL)
        pool.condemn([2])  # as if rank 2 had been silent, stuck with the dead rank
        second = pool.actors_for(3, BUNDLE)
        assert second[0]._actor_id == ids[0]
        assert second[1]._actor_id != ids[1] and second[2]._actor_id != ids[2]
        assert ray.get([actor.__ray_ready__.remote() for actor in second], timeout=60)
        assert lines[-1].startswith("recovery: ranks reused [0], restarted [1,2] "), lines
        # Another world size: a fresh set, the old actors gone.
        third = pool.actors_for(2, BUNDLE)
        assert len(third) == 2 and not {a._actor_id for a in third} & {a._actor_id for a in second}
    finally:
        pool.release()
        ray.shutdown()


@pytest.mark.slow  # decision 153: its own Ray and six actor starts (about a minute); the default suite's
# elastic case (tests/e2e/test_elastic.py) recovers through the pool
def test_a_killed_rank_is_restarted_and_the_others_are_reused():
    done = subprocess.run([sys.executable, "-c", "from tests.integration.test_rank_pool import _scenario; _scenario()"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
