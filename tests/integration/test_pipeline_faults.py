"""A stalled rank turns into a named timeout error at the driver, not a silent hang."""
import re

import pytest

from cluster.rank_group import StepFailed
from plans.layout import ParallelLayout
from tests.conftest import small_config


def test_stalled_rank_fails_the_step_naming_rank_step_and_action(run_training, tmp_path):
    # Rank 0 sleeps past the pipeline timeout before its first step; rank 1's first action
    # receives stage 0's output, so rank 1 gives up and names what it waited for.
    config = small_config(tmp_path, ParallelLayout(pp=2), schedule="1f1b", microbatches=2, steps=2,
                          pipeline_timeout_s=2.0, stall_rank=0, stall_seconds=4.0, run="stall")
    with pytest.raises(StepFailed) as failed:
        run_training(config)
    message = str(failed.value)
    assert re.search(r"rank 1 waited \d+ s at step 0 on RECV_F stage 1 microbatch 0 \(from pipeline rank 0\)", message), message
    assert "train_step failed" in message
