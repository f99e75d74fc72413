"""When the elastic group starts its warm spares (decision 215): at an attempt's first step past
the furthest step any attempt trained; so after a first start at once, after a recovery only once
the lost steps are redone, and once per attempt."""
from rayshard.cluster.run.elastic import TrainingWorkerGroup
from rayshard.plans.config import ModelChoice, TrainConfig


class CountingPool:
    """Stands in for the rank pool: only counts the calls to start spares (the pool itself is
    checked on real actors in tests/integration/test_rank_pool.py)."""

    def __init__(self):
        self.starts = 0

    def start_spares(self) -> None:
        self.starts += 1


def test_spares_start_past_the_furthest_step_and_once_per_attempt(tmp_path):
    group = TrainingWorkerGroup(TrainConfig(model=ModelChoice.named("tiny"), store=str(tmp_path), run="r"))
    group.pool = CountingPool()
    first = group._spares_once_regained()
    first(1)  # a first start: its first step is past everything
    assert group.pool.starts == 1
    for step in range(2, 16):
        first(step)
    assert group.pool.starts == 1 and group.furthest_step == 15
    recovery = group._spares_once_regained()  # resumed from step 10: steps 11-15 are redone first
    for step in range(11, 16):
        recovery(step)
    assert group.pool.starts == 1
    recovery(16)  # the first step past the failure
    assert group.pool.starts == 2
    recovery(17)
    assert group.pool.starts == 2 and group.furthest_step == 17
