"""Loss continuity across a reshard: train on layout A, resume on layout B, compare every step with
an uninterrupted run on A, and draw the picture.

The default version is short (4 steps on A, 6 on B, dp2 x tp2 -> tp2), every resumed step within
2.5e-6 relative. The issue's full version (50 on A, 200 on B) is marked slow:

    .venv/bin/python -m pytest -m slow tests/integration/test_reshard_continuity.py

Over 200 steps the resumed run and the uninterrupted one drift apart as any two layouts' float
reduction orders make them drift, by an amount that depends on the seed and on the machine (its
BLAS kernels' rounding, we suppose; not established): on one Xeon, seeds 7, 1, 2 and 3 reached
2.8e-6, 9.3e-5, 2.3e-6 and 2.4e-4 by step 250, where an earlier machine's stayed under 2.2e-6 for
all four. So the long version holds the
first 20 resumed steps to 2.5e-6 (before rounding has grown: a misplaced shard, stale optimizer
state or a data position off by one shows at the first resumed step) and the later ones to 1e-3
(4x the worst seed there) and to no further from the uninterrupted run than a run trained on B
from step 0 is (1.0e-2 to 4.4e-2 on the same seeds and machine).
"""
import pytest

from rayshard.plans.config import OptimizerConfig
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.integration.reshard_helpers import resume_continuity

# 4 ranks -> 2 ranks, as in the demo: dp2 x tp2 -> tp2.
A, B = ParallelLayout(dp=2, tp=2), ParallelLayout(tp=2)
TOLERANCE = 2.5e-6  # docs/checkpoints.md, "Resharding checkpoints": relative, per step
TIGHT_STEPS = 20  # resumed steps held to TOLERANCE in the long version (the docstring says why)
CEILING = 1e-3  # the later steps' bound: 4x the worst of four seeds on the machine that drifted most


def _config(tmp_path, layout, steps, total, run, **overrides):
    # The schedule's length is the whole run's, so the stop-and-resume run follows the same one.
    optimizer = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, decay_steps=total)
    return small_config(tmp_path, layout, steps=steps, run=run, optimizer=optimizer, **overrides)


def _continuity(run_training, tmp_path, before, after, tight_steps=None, ceiling=None):
    def config(layout, steps, total, run, **overrides):
        return _config(tmp_path, layout, steps, total, run, **overrides)

    picture, _, _ = resume_continuity(run_training, tmp_path, config, A, B, before, after, TOLERANCE, tight_steps, ceiling)
    return picture


@pytest.mark.slow  # decision 153: test_resume's onto-another-layout case runs the same path in the default suite
def test_resume_on_another_layout_continues_within_the_stated_tolerance(run_training, tmp_path):
    _continuity(run_training, tmp_path, before=4, after=6)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fifty_steps_on_a_then_two_hundred_on_b(run_training, tmp_path):
    picture = _continuity(run_training, tmp_path, before=50, after=200, tight_steps=TIGHT_STEPS, ceiling=CEILING)
    print(f"max relative difference over 200 resumed steps: {picture['max_relative_difference']:.2e}")
