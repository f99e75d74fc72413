"""A training driver in a process of its own, for the crash tests, which kill it mid-save.

    python -m tests.integration.crash_driver '{"store": ..., "run": ..., "steps": 3, ...}'

It joins the test session's Ray cluster (RAY_ADDRESS) and starts its own rank actors with no CPU
reservation (the session's actor pool holds every logical CPU); they die with this driver, as a
real job's actors do.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import ray

    from rayshard.actors.rank import RankActor
    from rayshard.cluster.run.train import train
    from rayshard.plans.config import OptimizerConfig
    from rayshard.plans.layout.parallel_layout import ParallelLayout
    from tests.conftest import small_config

    spec = json.loads(argv[0])
    layout = ParallelLayout(**spec.pop("layout"))
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="ERROR", log_to_driver=False)
    actors = [RankActor.options(num_cpus=0).remote() for _ in range(layout.world_size)]
    optimizer = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, decay_steps=8)
    train(small_config(Path("/nonexistent"), layout, optimizer=optimizer, **spec), actors)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
