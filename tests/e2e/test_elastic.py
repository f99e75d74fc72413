"""Elastic recovery on a real multi-node local Ray cluster (ray.cluster_utils.Cluster).

The scenario runs in a subprocess: it owns its own Ray cluster, separate from the test session's.
"""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from rayshard.plans.layout.parallel_layout import ParallelLayout

from tests.e2e.elastic_scenario import EVERY, SMALL_STEPS, STEPS, scenario_config

SCENARIO = Path(__file__).with_name("elastic_scenario.py")


def _run_scenario(root: Path, *flags: str) -> dict:
    out = root / "out.json"
    done = subprocess.run([sys.executable, str(SCENARIO), str(out), *flags], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("store", ["s3", pytest.param("az", marks=pytest.mark.slow)])  # Azure: -m slow (decision 113)
def test_a_rank_killed_on_a_small_cluster_is_replaced_and_the_run_resumes_from_latest(tmp_path, store):
    """The default suite's elastic case: a head and a worker node, 4 ranks, one rank SIGKILLed
    after checkpoint 2 (checkpoint 4 is held until then): the controller restarts on 4 ranks,
    resumes from step 2 (verified tensor for tensor) and finishes; no step is logged twice.
    On S3 (moto) and on Azure Blob Storage (Azurite), each behind the fault proxy."""
    if store == "az":
        from tests.azure_fixtures import install_azurite

        if install_azurite() is None:
            pytest.skip(install_azurite.reason)
    result = _run_scenario(tmp_path, "--small", *(["--azure"] if store == "az" else []))
    assert result["store"].startswith(f"{store}://")
    assert result["state"] == "finished" and result["latest_step"] == SMALL_STEPS
    assert [e["event"] for e in result["events"]] == ["kill_rank"] and result["events"][0]["after_checkpoint"] == EVERY
    states = [h["state"] for h in result["history"]]
    assert states.count("restarting") == 1 and "resizing" not in states, result["history"]
    running = [h["detail"].split("running ")[1] for h in result["history"] if h["state"] == "running"]
    assert running == ["dp4 on 4", "dp4 on 4"], running
    [check] = result["resume_checks"]
    assert check["step"] == EVERY and check["equal"] and check["tensors"] > 0, check
    assert [m["step"] for m in result["metrics"]] == list(range(1, SMALL_STEPS + 1))
    redone = [m for m in result["metrics"] if m["time"] > result["events"][0]["at"]]
    assert redone and redone[0]["step"] == EVERY + 1  # at most the steps since the last checkpoint are redone


@pytest.mark.slow  # the small cluster again, with the MoE model: about a minute on 2 cores
def test_an_expert_parallel_rank_killed_is_replaced_and_the_run_resumes_on_ep(tmp_path):
    """ep pinned to 2: every rank holds half of each MoE layer's experts and exchanges tokens with
    its ep peer, so a killed rank takes experts no other rank holds. The controller restarts on 4
    ranks with ep 2 again, resumes from step 2 verified tensor for tensor (the experts included)
    and finishes."""
    result = _run_scenario(tmp_path, "--small", "--moe")
    assert result["state"] == "finished" and result["latest_step"] == SMALL_STEPS
    assert [e["event"] for e in result["events"]] == ["kill_rank"]
    states = [h["state"] for h in result["history"]]
    assert states.count("restarting") == 1, result["history"]
    running = [h["detail"].split("running ")[1] for h in result["history"] if h["state"] == "running"]
    assert len(running) == 2 and all("(ep2)" in layout and layout.endswith(" on 4") for layout in running), running
    [check] = result["resume_checks"]
    assert check["step"] == EVERY and check["equal"] and check["tensors"] > 0, check
    assert ParallelLayout.parse(check["layout"]).ep == 2, check
    assert [m["step"] for m in result["metrics"]] == list(range(1, SMALL_STEPS + 1))
    assert all(m.get("expert_tokens") for m in result["metrics"]), result["metrics"][0]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    return _run_scenario(tmp_path_factory.mktemp("elastic"))


EVENTS = ["kill_rank", "kill_rank_mid_save", "remove_node", "add_node"]


@pytest.mark.slow  # a 3-node cluster with three injected faults: minutes on 2 cores
def test_rank_deaths_node_loss_and_growth_each_resume_from_latest(scenario):
    assert scenario["state"] == "finished" and scenario["latest_step"] == STEPS
    states = [h["state"] for h in scenario["history"]]
    assert states.count("restarting") == 3 and states.count("resizing") == 1
    running = [h["detail"] for h in scenario["history"] if h["state"] == "running"]
    # 8 ranks; the same 8 after each rank death; dp4 on the 6 left after a node goes; 8 again
    # when it is back.
    assert [d.split("running ")[1] for d in running] == ["dp8 on 8", "dp8 on 8", "dp8 on 8", "dp4 on 4", "dp8 on 8"]
    assert [e["event"] for e in scenario["events"]] == EVENTS


@pytest.mark.slow  # a 3-node cluster with three injected faults: minutes on 2 cores
def test_a_rank_killed_mid_save_leaves_latest_on_the_previous_checkpoint(scenario):
    mid_save = scenario["events"][1]
    assert "/checkpoints/step-00000006/attempt-" in mid_save["request"]
    assert mid_save["after_checkpoint"] == 4  # the dying save never became visible


@pytest.mark.slow  # a 3-node cluster with three injected faults: minutes on 2 cores
def test_every_resume_loaded_exactly_the_last_committed_checkpoint(scenario):
    checks = scenario["resume_checks"]
    # Two rank deaths, a node loss and a resize: four resumes, each verified tensor for tensor
    # (digests of the state the ranks hold against the checkpoint's) on the layout it resumed onto.
    resized_after = next(int(h["detail"].rsplit(" ", 1)[1]) for h in scenario["history"] if h["state"] == "resizing")
    resumed_from = [e["after_checkpoint"] for e in scenario["events"][:3]] + [resized_after]
    assert [(c["step"], ParallelLayout.parse(c["layout"]).describe()) for c in checks] == list(zip(resumed_from, ["dp8", "dp8", "dp4", "dp8"])), checks
    assert all(c["equal"] and c["tensors"] > 0 for c in checks), checks


@pytest.mark.slow  # a 3-node cluster with three injected faults: minutes on 2 cores
def test_one_timeline_and_losses_continue_an_uninterrupted_run(scenario, run_training, tmp_path):
    steps = [m["step"] for m in scenario["metrics"]]
    assert steps == list(range(1, STEPS + 1))  # work lost to a failure is redone once, not duplicated
    reference_config = scenario_config(str(tmp_path / "ref"))
    from dataclasses import replace

    reference = run_training(replace(reference_config, layout=ParallelLayout(dp=2),
                                     checkpoint=replace(reference_config.checkpoint, resume=None, every=0)))
    for record in scenario["metrics"]:
        assert math.isclose(record["loss"], reference.losses[record["step"]], rel_tol=1e-5), record


@pytest.mark.slow  # a 3-node cluster with three injected faults: minutes on 2 cores
def test_lost_work_is_at_most_the_steps_since_the_last_checkpoint(scenario):
    for event in scenario["events"][:3]:
        # The first step finished after the fault is the one right after LATEST at that moment.
        redone = [m for m in scenario["metrics"] if m["time"] > event["at"]]
        assert redone and redone[0]["step"] == event["after_checkpoint"] + 1, (event, redone[:2])
