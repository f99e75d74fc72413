"""Loss continuity across a reshard: train on layout A, resume on layout B, compare every step with
an uninterrupted run on A (fp32, within the README's 2.5e-6 relative per step), and draw the picture.

The default version is short (4 steps on A, 6 on B, dp2 x tp2 -> tp2); the issue's full
version (50 on A, 200 on B) is marked slow:

    .venv/bin/python -m pytest -m slow tests/integration/test_reshard_continuity.py
"""
import pytest

from cluster.pictures.resume_plot import plot_resume
from cluster.storage.store import Store
from plans.config import OptimizerConfig
from plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config

# 4 ranks -> 2 ranks, as in the demo: dp2 x tp2 -> tp2.
A, B = ParallelLayout(dp=2, tp=2), ParallelLayout(tp=2)
TOLERANCE = 2.5e-6  # README, "Resharding checkpoints": relative, per step


def _config(tmp_path, layout, steps, total, run, **overrides):
    # The schedule's length is the whole run's, so the stop-and-resume run follows the same one.
    optimizer = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3, decay_steps=total)
    return small_config(tmp_path, layout, steps=steps, run=run, optimizer=optimizer, **overrides)


def _continuity(run_training, tmp_path, before, after):
    total = before + after
    full = run_training(_config(tmp_path, A, total, total, "uninterrupted"))
    run_training(_config(tmp_path, A, before, total, "resumed"))
    resumed = run_training(_config(tmp_path, B, total, total, "resumed", resume="latest"))
    assert resumed.start_step == before
    for step in range(before + 1, total + 1):
        assert resumed.losses[step] == pytest.approx(full.losses[step], rel=TOLERANCE, abs=0), step
    picture = plot_resume(Store(str(tmp_path / "store")), ["resumed"], str(tmp_path / "resume.png"), reference="uninterrupted")
    assert picture["steps_compared"] == total and picture["max_relative_difference"] <= TOLERANCE
    assert len(picture["segments"]) == 2  # layout A, then layout B, in their own colours
    assert (tmp_path / "resume.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return picture


def test_resume_on_another_layout_continues_within_the_stated_tolerance(run_training, tmp_path):
    _continuity(run_training, tmp_path, before=4, after=6)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fifty_steps_on_a_then_two_hundred_on_b(run_training, tmp_path):
    picture = _continuity(run_training, tmp_path, before=50, after=200)
    print(f"max relative difference over 200 resumed steps: {picture['max_relative_difference']:.2e}")
