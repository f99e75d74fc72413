"""A trainer that died between a checkpoint's manifest and the LATEST move (the commit window)
leaves a whole checkpoint LATEST does not name. Resubmitting the run continues it: the checkpoint
is recognised as the run's own (its lineage reaches LATEST) and adopted, never retrained into a
clash with its own manifest; one that is not the run's own is refused in one line; a resume that
would commit an existing step again is refused before its first step. The window is reproduced
exactly by setting LATEST back one checkpoint, as the crash leaves it (the S3 kill between the
two writes is in test_commit_crashes.py)."""
from __future__ import annotations

import shutil

import pytest

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.run.controller import Controller, State
from rayshard.cluster.run.elastic import TrainingWorkerGroup
from rayshard.plans.errors import CheckpointError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.integration.test_s3_training import _config

FSDP2 = ParallelLayout(fsdp=2)


@pytest.fixture
def window_crash(run_training, tmp_path):
    """Run 'w' with steps 1 and 2 committed and LATEST still naming step 1."""
    run_training(_config(tmp_path, FSDP2, steps=2, run="w", ckpt_every=1))
    store = Store(str(tmp_path / "store"))
    store.write_text("w/LATEST", "step-00000001")
    assert store.latest_step("w") == 1 and store.committed_steps("w") == [1, 2]
    return store


@pytest.mark.parametrize("resume", ["auto", "latest", "w"])
def test_a_resume_adopts_the_commit_latest_missed(resume, window_crash, run_training, tmp_path, capfd):
    resumed = run_training(_config(tmp_path, FSDP2, steps=3, run="w", ckpt_every=1, resume=resume))
    assert resumed.start_step == 2 and resumed.checkpoints[-1].endswith("step-00000003")
    assert window_crash.latest_step("w") == 3 and window_crash.committed_steps("w") == [1, 2, 3]
    assert "step 2 was committed but LATEST still named step 1" in capfd.readouterr().err


def test_an_elastic_restart_adopts_it_too(window_crash, rank_pool, tmp_path):
    """The elastic controller's attempt (resume=auto) on the borrowed ranks: finished, not errored."""
    config = _config(tmp_path, FSDP2, steps=3, run="w", ckpt_every=1)
    group = TrainingWorkerGroup(config, 2, actors=rank_pool)
    controller = Controller(group, choose=lambda ranks: FSDP2, log=lambda message: None)
    assert controller.run() is State.FINISHED, [t.detail for t in controller.history]
    assert window_crash.latest_step("w") == 3


def test_a_commit_that_is_not_the_runs_own_is_refused(window_crash, run_training, tmp_path, capfd):
    # Another run's step 2, copied into w's catalog by hand: whole, but not of w's lineage.
    run_training(_config(tmp_path, FSDP2, steps=2, run="other"))
    checkpoints = tmp_path / "store" / "w" / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000002")
    shutil.copytree(tmp_path / "store" / "other" / "checkpoints" / "step-00000002", checkpoints / "step-00000002")
    with pytest.raises(CheckpointError, match=r"run 'w': step 2 is committed past LATEST \(step 1\) but does not "
                                              r"descend from step 1 .*Fix: resume it on purpose with --resume w@2"):
        run_training(_config(tmp_path, FSDP2, steps=3, run="w", resume="auto"))
    assert window_crash.latest_step("w") == 1  # nothing moved, nothing deleted
    assert window_crash.committed_steps("w") == [1, 2]
    # Taken on purpose, it resumes, with a note that it is another run's.
    resumed = run_training(_config(tmp_path, FSDP2, steps=3, run="w", resume="w@2"))
    assert resumed.start_step == 2 and window_crash.latest_step("w") == 3
    assert "sits in run 'w' but was written by run 'other' (copied in?)" in capfd.readouterr().out


@pytest.mark.parametrize("steps", [3, 1])  # would commit step 2 again; would move LATEST back behind step 2
def test_a_resume_at_an_older_step_of_the_run_stops_before_training(steps, window_crash, run_training, tmp_path):
    window_crash.write_text("w/LATEST", "step-00000002")
    with pytest.raises(CheckpointError, match=r"already has committed checkpoints past step 1 \(steps \[2\]\).*"
                                              r"--resume w@1 --run NEW_NAME"):
        run_training(_config(tmp_path, FSDP2, steps=steps + 1, run="w", ckpt_every=1, resume="w@1"))
    assert window_crash.latest_step("w") == 2


def test_an_elastic_restart_on_a_damaged_checkpoint_stops_in_one_line(window_crash, rank_pool, tmp_path):
    """A truncated shard in the commit past LATEST is not a failure a retry can fix, and not one
    to adopt: LATEST stays on the whole step, and the controller stops at once (no replan loop)
    with one line naming the step, what is wrong and the fix."""
    shard = next((tmp_path / "store" / "w" / "checkpoints" / "step-00000002").glob("attempt-*/rank-00000.*"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    config = _config(tmp_path, FSDP2, steps=3, run="w", ckpt_every=1)
    history = []
    controller = Controller(TrainingWorkerGroup(config, 2, actors=rank_pool), choose=lambda ranks: FSDP2,
                            log=history.append)
    with pytest.raises(CheckpointError) as raised:
        controller.run()
    message = str(raised.value)
    assert "\n" not in message and "step 2 is committed past LATEST (step 1) but damaged" in message, message
    assert "--resume w@1 --run NEW_NAME" in message, message
    assert sum("[controller] running" in line for line in history) == 1, history
    assert window_crash.latest_step("w") == 1  # nothing moved, nothing deleted
    assert window_crash.committed_steps("w") == [1, 2]
