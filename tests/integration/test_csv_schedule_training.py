"""A pipeline order from torch's own CSV dump trains like rayshard's schedule of the same name."""
from __future__ import annotations

import math

import pytest

from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.pipeline.csv_order import CSV_SCHEDULE
from tests.conftest import small_config
from tests.unit.test_csv_schedule import torch_csv


@pytest.mark.parametrize("name, fmt", [("interleaved1f1b", "compute_comms"),
                                       pytest.param("zbv", "compute_only", marks=pytest.mark.slow)])
def test_torch_order_trains_like_ours(run_training, tmp_path, name, fmt):
    rows = tuple(tuple(row) for row in torch_csv(name, tmp_path / "order.csv", fmt=fmt))
    layout = ParallelLayout(pp=2, vpp=2)
    common = dict(global_batch=8, seq_len=16, microbatches=4, steps=4)
    ours = run_training(small_config(tmp_path / "ours", layout, schedule=name, run="ours", **common)).losses
    theirs = run_training(small_config(tmp_path / "csv", layout, schedule=CSV_SCHEDULE, schedule_csv=rows,
                                       run="csv", **common)).losses
    assert sorted(theirs) == [1, 2, 3, 4]
    for step, loss in ours.items():
        # The same microbatch gradients, accumulated in the file's order.
        assert math.isclose(theirs[step], loss, rel_tol=1e-6), (step, theirs[step], loss)
    if name == "interleaved1f1b":  # torch's order is ours action for action: bit-equal
        assert theirs == ours
