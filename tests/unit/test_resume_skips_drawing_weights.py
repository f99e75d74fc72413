"""A resume whose checkpoint fills every parameter starts its ranks without drawing initial
weights (docs/decisions.md 219); anything else draws them."""
from __future__ import annotations

import pytest

from rayshard.cluster.catalog.store import CheckpointRef, Store
from rayshard.cluster.run.train import StartPoint, filled_by_resume
from rayshard.plans.config import LoraConfig, ModelChoice, TrainConfig


def _point(tmp_path, resume: bool, lora: LoraConfig | None = None) -> StartPoint:
    config = TrainConfig(model=ModelChoice.named("tiny"), store=str(tmp_path), run="r",
                         **({"lora": lora} if lora is not None else {}))
    ref = CheckpointRef(f"{tmp_path}/r/step-00000010", "r", 10) if resume else None
    return StartPoint(config, Store(str(tmp_path)), 10 if resume else 0, ref)


def test_a_full_parameter_resume_skips_the_draw(tmp_path):
    assert filled_by_resume(_point(tmp_path, resume=True))


def test_a_fresh_run_draws(tmp_path):
    assert not filled_by_resume(_point(tmp_path, resume=False))


@pytest.mark.parametrize("base", [None, "base-run"])
def test_a_run_with_frozen_parameters_draws_even_when_resuming(tmp_path, base):
    # The frozen weights are the drawn ones (no base) or come from the base's own load.
    assert not filled_by_resume(_point(tmp_path, resume=True, lora=LoraConfig(rank=4, alpha=8.0, base=base)))
