"""A reused rank lets go of each run's process groups (decision 233).

DTensor's process-wide caches (sharding, redistribution, mesh topology) and our own region memo
held every run's device meshes, and through them the run's gloo groups: each kept its loop thread
and its peer connections after `destroy_process_group`. The session pool's ranks gathered
hundreds of loop threads over the default suite, and their polling took more CPU than the runs.
A run's groups are now gone when its ranks shut down: no gloo thread is left between runs; a
failed run's are kept until their own timeout has passed, then let go at the next set-up."""
import os
import time

import pytest

from rayshard.actors.parallel.failed_groups import MARGIN_S
from rayshard.cluster.run.rank_group import StepFailed
from rayshard.cluster.run.train import train
from rayshard.plans.config import ResourcesConfig
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.rank_faults import ranks_with_fault


def threads_in(ray, actors) -> list[int]:
    """Each rank's gloo transport threads (one per live group's device), counted in its process."""
    def gloo_loop_threads(_actor) -> int:  # nested: sent by value, as the test module is not on the ranks' path
        count = 0
        for thread in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{thread}/comm") as name:
                    count += name.read().strip() == "gloo_tcp_loop"
            except OSError:  # the thread ended meanwhile
                pass
        return count

    return ray.get([actor.__ray_call__.remote(gloo_loop_threads) for actor in actors], timeout=60)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_runs_on_reused_ranks_leave_no_gloo_group_behind(run_training, rank_pool, ray_session, tmp_path):
    # Compared with before each run, not with none: a run that failed earlier in the session on
    # these ranks keeps its groups until their timeout has passed (the test below).
    for index, layout in enumerate([ParallelLayout(dp=2, tp=2), ParallelLayout(fsdp=2, tp=2)]):
        before = threads_in(ray_session, rank_pool[:4])
        run_training(small_config(tmp_path / str(index), layout, steps=2, ckpt_every=2))
        after = threads_in(ray_session, rank_pool[:4])
        assert all(a <= b for a, b in zip(after, before)), f"after the run on {layout}: {after}, before it {before}"


@pytest.mark.slow  # fresh actors and a wait past the timeout; test_group_leaving runs the failure path by default
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
def test_a_failed_runs_groups_are_kept_past_their_timeout_then_let_go(ray_session, tmp_path):
    """Freed at once, a failed run's group whose worker still waits in an operation would stop the
    rank in its destructor: the survivors keep them until the groups' timeout has passed, and the
    next run's set-up lets go of them."""
    timeout_s = 5.0
    failing = small_config(tmp_path / "failing", ParallelLayout(dp=2, tp=2), steps=3, run="failing",
                           resources=ResourcesConfig(collective_timeout_s=timeout_s))
    with ranks_with_fault(ray_session, 4, kind="exit", rank=3, at_step=1) as actors:
        with pytest.raises(StepFailed):
            train(failing, actors)
        failed_at = time.monotonic()
        survivors = actors[:3]
        assert all(threads_in(ray_session, survivors)), "kept until their timeout"
        time.sleep(max(0.0, failed_at + timeout_s + MARGIN_S - time.monotonic()))
        train(small_config(tmp_path / "next", ParallelLayout(dp=3), steps=2, global_batch=6, run="next"), survivors)
        assert threads_in(ray_session, survivors) == [0, 0, 0]
