"""examples/ray_train on a real local Ray (Ray Train v2 TorchTrainer, gloo on CPU, FSDP2): 4
workers save through `rayshard.checkpoint` and report each committed checkpoint to Ray Train; a
restart of the same Ray Train run on 2 workers resumes from Ray Train's latest checkpoint and its
losses continue an uninterrupted 4-worker run's within 2.5e-6 relative. A worker killed mid-save
leaves no checkpoint reported to Ray Train and none committed in rayshard's run.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples.ray_train.train import POINTER, trainer
from rayshard.cluster.catalog.store import Store
from tests.integration.ray_train_faults import train_func_dying_in_save

TOLERANCE = 2.5e-6
# No CPU per worker, a MiB of Ray's memory resource instead (Ray refuses an empty bundle): the
# session's Ray may already lend all its 8 logical CPUs to the shared rank pool (tests/conftest.py).
RESOURCES = {"CPU": 0, "memory": 2**20}


@pytest.fixture(autouse=True)
def _ray_train(ray_session, monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")
    monkeypatch.setenv("RAYSHARD_CHECKPOINT_TIMEOUT_S", "120")  # workers started from here inherit it


def _fit(tmp_path: Path, name: str, workers: int, steps: int, save_every: int, train_func=None, **extra):
    config = {"where": str(tmp_path / "store" / name), "steps": steps, "save_every": save_every, **extra}
    fitted = trainer(config, workers, str(tmp_path / "ray"), name, resources_per_worker=RESOURCES)
    if train_func is not None:
        fitted.train_loop_per_worker = train_func
    return fitted.fit()


def _reported(tmp_path: Path, name: str) -> list[tuple[int, dict, dict]]:
    """Ray Train's record of the run: (step, metrics, the pointer file) per reported checkpoint."""
    from ray.train import Result

    result = Result.from_path(str(tmp_path / "ray" / name))
    rows = []
    for checkpoint, metrics in result.best_checkpoints:
        with checkpoint.as_directory() as directory:
            rows.append((metrics["step"], metrics, json.loads(Path(directory, POINTER).read_text())))
    return sorted(rows, key=lambda row: row[0])


def _losses(rows) -> dict[int, float]:
    return {step: loss for _, metrics, _ in rows for step, loss in metrics["losses"]}


@pytest.mark.slow
def test_four_workers_save_two_resume_and_losses_continue(tmp_path):
    _fit(tmp_path, "whole", workers=4, steps=8, save_every=4)
    whole = _losses(_reported(tmp_path, "whole"))
    assert sorted(whole) == list(range(1, 9))

    _fit(tmp_path, "split", workers=4, steps=4, save_every=2)
    result = _fit(tmp_path, "split", workers=2, steps=8, save_every=2)  # same RunConfig: resumes at 4
    rows = _reported(tmp_path, "split")
    assert [step for step, _, _ in rows] == [2, 4, 6, 8]
    assert result.metrics["step"] == 8
    split = _losses(rows)
    assert sorted(split) == list(range(1, 9))  # steps 1-4 on 4 workers, 5-8 on 2: none trained twice
    for step in range(1, 9):
        assert abs(split[step] - whole[step]) <= TOLERANCE * abs(whole[step]), (step, split[step], whole[step])
    store = Store(str(tmp_path / "store"))
    assert store.committed_steps("split") == [2, 4, 6, 8] and store.latest_step("split") == 8
    for step, _, pointer in rows:  # each report names the rayshard checkpoint committed at its step
        assert pointer["step"] == step and pointer["checkpoint"] == store.checkpoint_url("split", step)


# Under -m slow: in a fresh-clone CI run of the default suite, after this test had run in the
# session's Ray, a later `ray.cluster_resources()` in the test process (tests/unit/
# test_rank_resources.py, the elastic chooser) waited forever inside Ray's GCS state accessor; the
# cause is not found yet (Ray Train v2's controller in the test's own driver is the new suspect).
@pytest.mark.slow
def test_worker_killed_mid_save_leaves_nothing_reported_or_committed(tmp_path):
    from ray.train import TrainingFailedError

    with pytest.raises(TrainingFailedError):
        _fit(tmp_path, "killed", workers=2, steps=2, save_every=1, train_func=train_func_dying_in_save,
             die_rank=1, die_in_save=2)
    rows = _reported(tmp_path, "killed")
    assert [step for step, _, _ in rows] == [1]  # step 2's save never returned: never reported
    store = Store(str(tmp_path / "store"))
    assert store.committed_steps("killed") == [1] and store.latest_step("killed") == 1
    assert rows[0][2]["checkpoint"] == store.checkpoint_url("killed", 1)
