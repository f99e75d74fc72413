"""The elastic run's rank pool on real Ray actors (decisions 149, 185): after a failure it keeps
the actors that answer, waits a bound for peers still busy with the failed step, replaces the
dead, silent peers that have a warm spare on their node, and peers silent past their bound (each
from a warm spare on its node where one waits, or one started for it as it stayed silent, named),
and starts afresh for another world size.

The pool reserves CPUs in a placement group, and the test session's Ray lends all of its CPUs to
the session's actor pool; so the scenario runs in a subprocess with a small Ray of its own."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = {"CPU": 0.25}


def _scenario() -> None:
    import ray

    from rayshard.cluster.run.rank_pool import RankPool

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    lines = []
    pool = RankPool(start_timeout_s=120, log=lines.append, busy_peer_bound_s=60)
    try:
        first = pool.actors_for(3, BUNDLE)
        assert not pool.spares  # started once the attempt has trained a step (decision 213), as the trainer asks
        pool.start_spares()
        ids = [actor._actor_id for actor in first]
        [spare] = pool.spares.values()  # one node: one warm spare
        ray.get(spare.__ray_ready__.remote(), timeout=120)
        victim = ray.get(first[1].__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        # Rank 2 is still busy with the failed step for longer than a plain probe waits (2 s).
        first[2].__ray_call__.remote(lambda self: time.sleep(6))
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        pool.condemn([1])  # dead
        pool.expect_busy([2])  # silent: the failed step named it, it was computing
        second = pool.actors_for(3, BUNDLE)
        assert second[0]._actor_id == ids[0] and second[2]._actor_id == ids[2]  # the busy peer was waited for
        assert second[1]._actor_id == spare._actor_id  # the dead rank's place went to the warm spare
        assert ray.get([actor.__ray_ready__.remote() for actor in second], timeout=60)
        assert lines[-1].startswith("recovery: ranks reused [0,2], restarted [1] "), lines
        assert "rank(s) [2] waited for" in lines[-1] and "rank(s) [1] from a warm spare" in lines[-1], lines
        # Rank 2 was silent past the plain probe's 2 s: a spare started on its node then (decision
        # 216), and as rank 2 answered, it stays the node's warm spare.
        assert "a spare started for rank(s) [2], silent after 2 s" in lines[-1], lines
        [spare] = pool.spares.values()
        assert spare._actor_id not in {a._actor_id for a in second}
        pool.start_spares()  # the node has its spare: none more
        assert list(pool.spares.values()) == [spare]
        ray.get(spare.__ray_ready__.remote(), timeout=120)
        # A silent peer with a warm spare on its node is replaced at once, not waited for.
        second[0].__ray_call__.remote(lambda self: time.sleep(600))
        pool.expect_busy([0])
        third = pool.actors_for(3, BUNDLE)
        assert third[0]._actor_id == spare._actor_id and [a._actor_id for a in third[1:]] == [a._actor_id for a in second[1:]]
        assert lines[-1].startswith("recovery: ranks reused [1,2], restarted [0] "), lines
        assert "rank(s) [0] from a warm spare" in lines[-1] and "waited for" not in lines[-1], lines
        # Without a spare, a peer still silent after its bound is stuck: replaced and named.
        for idle in pool.spares.values():
            ray.kill(idle)
        pool.spares, pool.warm_spares, pool.busy_peer_bound_s = {}, False, 3.0
        third[1].__ray_call__.remote(lambda self: time.sleep(600))
        pool.expect_busy([1])
        fourth = pool.actors_for(3, BUNDLE)
        assert fourth[1]._actor_id != third[1]._actor_id and fourth[0]._actor_id == third[0]._actor_id
        assert lines[-1].startswith("recovery: ranks reused [0,2], restarted [1] "), lines
        assert "rank(s) [1] did not answer within 3 s (treated as lost)" in lines[-1], lines
        # Asked of its own thread before it was killed (a sleep, not a step, load or save, here).
        assert "; rank 1 was in no step, load or save" in lines[-1], lines
        # With spares on, a silent peer and no spare on its node: one starts after 2 s, and takes the
        # stuck peer's place when its bound ends (not a new actor started only then).
        pool.warm_spares, pool.busy_peer_bound_s = True, 4.0
        fourth[2].__ray_call__.remote(lambda self: time.sleep(600))
        pool.expect_busy([2])
        fifth = pool.actors_for(3, BUNDLE)
        assert fifth[2]._actor_id != fourth[2]._actor_id and [a._actor_id for a in fifth[:2]] == [a._actor_id for a in fourth[:2]]
        assert lines[-1].startswith("recovery: ranks reused [0,1], restarted [2] "), lines
        assert "a spare started for rank(s) [2], silent after 2 s" in lines[-1], lines
        assert "rank(s) [2] did not answer within 4 s (treated as lost)" in lines[-1], lines
        assert "rank(s) [2] from a warm spare" in lines[-1] and not pool.spares, lines
        third = fifth
        # Another world size: a fresh set, the old actors gone.
        other = pool.actors_for(2, BUNDLE)
        assert len(other) == 2 and not {a._actor_id for a in other} & {a._actor_id for a in third}
    finally:
        pool.release()
        ray.shutdown()


GPU_BUNDLE = {"CPU": 0.25, "GPU": 1}


def _gpu_scenario() -> None:
    """GPU ranks' warm spares (decision 225), on a Ray that declares two GPUs this machine need not
    have: Ray assigns them (CUDA_VISIBLE_DEVICES) as on a GPU node, and nothing here initialises
    CUDA, so the spare's hand-over is checked to the device each actor would train on."""
    import ray

    from rayshard.cluster.run.rank_pool import RankPool

    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, logging_level="WARNING",
             log_to_driver=False)
    lines = []
    pool = RankPool(start_timeout_s=120, log=lines.append, busy_peer_bound_s=60)
    try:
        first = pool.actors_for(2, GPU_BUNDLE)
        assert sorted(pool.devices.values()) == ["0", "1"], pool.devices  # one GPU each, as Ray assigned
        pool.start_spares()
        [spare] = pool.spares.values()  # a GPU rank's node gets a spare too, reserving no GPU
        assert ray.get(spare.__ray_call__.remote(lambda self: (ray.get_gpu_ids(), self.device_kind())),
                       timeout=120) == ([], "cpu")
        dead_devices = pool.devices[1]
        victim = ray.get(first[1].__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        os.kill(victim, signal.SIGKILL)
        pool.condemn([1])
        second = pool.actors_for(2, GPU_BUNDLE)
        assert second[1]._actor_id == spare._actor_id and second[0]._actor_id == first[0]._actor_id
        assert "rank(s) [1] from a warm spare" in lines[-1], lines
        # It trains on the dead rank's GPU: CUDA_VISIBLE_DEVICES set before CUDA starts, the device cuda.
        taken = ray.get(second[1].__ray_call__.remote(
            lambda self: (os.environ["CUDA_VISIBLE_DEVICES"], self.device_kind(), self.visible_devices())), timeout=60)
        assert taken == (dead_devices, "cuda", dead_devices), taken
        assert pool.devices[1] == dead_devices
        # A spare that cannot take the GPUs in time (busy here) is not used: a new actor in the
        # rank's bundle takes the place, with the GPU Ray assigns it there.
        pool.start_spares()
        [busy_spare] = pool.spares.values()
        ray.get(busy_spare.__ray_ready__.remote(), timeout=120)
        busy_spare.__ray_call__.remote(lambda self: time.sleep(600))
        victim = ray.get(second[0].__ray_call__.remote(lambda self: os.getpid()), timeout=60)
        os.kill(victim, signal.SIGKILL)
        pool.condemn([0])
        third = pool.actors_for(2, GPU_BUNDLE)
        assert third[0]._actor_id not in {busy_spare._actor_id, second[0]._actor_id}
        assert any(line.startswith("warm spare not used for rank 0") for line in lines), lines
        assert lines[-1].startswith("recovery: ranks reused [1], restarted [0] ") and "from a warm spare" not in lines[-1], lines
        assert ray.get(third[0].__ray_call__.remote(lambda self: (ray.get_gpu_ids() != [], self.device_kind())),
                       timeout=60) == (True, "cuda")
        assert sorted(pool.devices.values()) == ["0", "1"], pool.devices
    finally:
        pool.release()
        ray.shutdown()


@pytest.mark.slow  # its own Ray, four actor starts
def test_a_gpu_ranks_spare_takes_the_dead_ranks_gpu():
    done = subprocess.run([sys.executable, "-c", "from tests.integration.test_rank_pool import _gpu_scenario; _gpu_scenario()"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow  # decision 153: its own Ray and six actor starts (about a minute); the default suite's
# elastic case (tests/e2e/test_elastic.py) recovers through the pool
def test_a_killed_rank_is_replaced_by_a_spare_and_busy_peers_are_waited_for_and_reused():
    done = subprocess.run([sys.executable, "-c", "from tests.integration.test_rank_pool import _scenario; _scenario()"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
