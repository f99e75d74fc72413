"""A stalled rank turns into a named timeout error at the driver, not a silent hang."""
import re

import pytest

from rayshard.cluster.run.elastic import RANK_FAILURES
from rayshard.cluster.run.rank_group import StepFailed
from rayshard.cluster.run.train import train
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.rank_faults import ranks_with_fault


def test_stalled_rank_fails_the_step_naming_rank_step_and_action(ray_session, tmp_path):
    # Rank 0 sleeps past the pipeline timeout before its first step; rank 1's first action
    # receives stage 0's output, so rank 1 gives up and names what it waited for.
    config = small_config(tmp_path, ParallelLayout(pp=2), schedule="1f1b", microbatches=2, steps=2,
                          pipeline_timeout_s=2.0, run="stall")
    with ranks_with_fault(ray_session, 2, kind="stall", rank=0, seconds=4.0) as actors:
        with pytest.raises(StepFailed) as failed:
            train(config, actors)
    message = str(failed.value)
    assert re.search(r"rank 1 waited \d+ s at step 0 on RECV_F stage 1 microbatch 0 \(from pipeline rank 0\)", message), message
    assert "train_step failed" in message


# The transfer timeout is far beyond this test's own timeout: a driver that waited it out would
# fail the test (pytest-timeout) instead of passing late.
@pytest.mark.timeout(300)
def test_a_rank_that_dies_mid_step_fails_the_step_without_waiting_out_the_timeout(ray_session, tmp_path):
    """Rank 3 of dp2 x pp2 exits inside its first step while rank 2 waits on it for a gradient
    and ranks 0 and 1 will wait in the dp all-reduce: the driver names the dead rank (not after
    the transfer timeout, which no rank reached) and the elastic controller treats it as a
    recoverable rank failure."""
    config = small_config(tmp_path, ParallelLayout(dp=2, pp=2), schedule="1f1b", microbatches=2, steps=2,
                          pipeline_timeout_s=3600.0, run="dies")
    with ranks_with_fault(ray_session, 4, kind="exit", rank=3) as actors:
        with pytest.raises(StepFailed) as failed:
            train(config, actors)
    assert failed.value.dead_ranks == [3], str(failed.value)
    assert "rank 3:" in str(failed.value) and "train_step failed" in str(failed.value)
    assert not any(re.search(r"waited \d+ s", message) for message in failed.value.failures.values()), str(failed.value)
    assert isinstance(failed.value, RANK_FAILURES)


@pytest.mark.slow  # decision 153: the dead-rank and stalled-rank cases keep "never a silent hang" in the default suite
@pytest.mark.timeout(300)
def test_a_rank_that_raises_mid_step_stops_its_peers_at_once_and_is_named_first(ray_session, tmp_path):
    """Rank 3 of dp2 x pp2 raises inside its first step, alive, while its peers wait on it in a
    transfer and the dp all-reduce with an hour's timeout: it leaves the process group, so they
    fail within seconds (each naming the lost peer), and the driver's error names rank 3 first; a
    peer that leaving did not reach is named silent after a short grace, not waited for."""
    config = small_config(tmp_path, ParallelLayout(dp=2, pp=2), schedule="1f1b", microbatches=2, steps=2,
                          pipeline_timeout_s=3600.0, run="raises")
    with ranks_with_fault(ray_session, 4, kind="raise", rank=3) as actors:
        with pytest.raises(StepFailed) as failed:
            train(config, actors)
    lines = str(failed.value).splitlines()
    assert lines[0].startswith("train_step failed on") and lines[1].startswith("  rank 3: RuntimeError: injected fault"), lines
    assert failed.value.waited_s < 120, str(failed.value)  # not the hour a peer would wait
    assert len(failed.value.failures) >= 2, str(failed.value)  # its peers failed with it, not waited
