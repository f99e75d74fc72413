"""A rank whose process dies mid-step fails every peer within the grace, none left silent.

dp2 x tp2, rank 3 exits at the start of its second step: rank 2 (its tp peer) and rank 1 (its
dp peer) fail on its closed sockets, leave their groups and answer. Rank 0 shares no group with
rank 3: it waits in a collective with ranks 1 and 2 and fails only when their sockets close.
Those stayed open after they left (a gloo group's pairs outlive its destruction while the group's
worker holds an operation, here FSDP's, that rank 0 never joins), so rank 0 waited out the
collective timeout and the driver named it silent; a recovery then replaced it. Now a failing
rank half-closes its groups' connections first (decision 232), and every survivor stays alive."""
import time

import pytest

from rayshard.cluster.run.rank_group import StepFailed
from rayshard.cluster.run.train import train
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.rank_faults import ranks_with_fault


@pytest.mark.timeout(300)
def test_a_dead_ranks_diagonal_peer_fails_at_once_instead_of_falling_silent(ray_session, tmp_path):
    config = small_config(tmp_path, ParallelLayout(dp=2, tp=2), steps=3, run="diagonal")
    with ranks_with_fault(ray_session, 4, kind="exit", rank=3, at_step=1) as actors:
        with pytest.raises(StepFailed) as failed:
            train(config, actors)
        assert failed.value.dead_ranks == [3], str(failed.value)
        assert failed.value.silent == [], str(failed.value)
        assert sorted(failed.value.failures) == [0, 1, 2, 3], str(failed.value)
        time.sleep(2.0)  # what cutting a group's connections might break would have broken by now
        for survivor in actors[:3]:  # alive and free, so a recovery reuses them (RankPool probes so)
            ray_session.get(survivor.__ray_ready__.remote(), timeout=10)  # raises where it died
