"""Recovery from snapshots in the nodes' memory on a real 3-node local Ray cluster (issue 41).

Each scenario runs in a subprocess that owns its cluster (tests/e2e/snapshot_scenario.py): a
snapshot every step, no durable checkpoint before the end, a fault after step 4's snapshot.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.snapshot_scenario import KILL_AT

SCENARIO = Path(__file__).with_name("snapshot_scenario.py")
STEPS = 8
TOLERANCE = 2.5e-6  # relative, per step (the bound for a resumed run on another layout)


def _run(tmp_path: Path, fault: str) -> dict:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(SCENARIO), str(out), "--fault", fault, "--steps", str(STEPS)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


def _assert_continues_the_reference(result: dict) -> None:
    losses = {int(step): loss for step, loss in result["losses"].items()}
    reference = {int(step): loss for step, loss in result["reference"].items()}
    assert sorted(losses) == list(range(1, STEPS + 1)) == sorted(reference)
    for step in losses:
        assert abs(losses[step] - reference[step]) <= TOLERANCE * abs(reference[step]), (step, losses[step], reference[step])


def _recovery_lines(result: dict) -> list[str]:
    return [line for line in result["log"] if line.startswith(("recovery:", "loaded step"))]


def _resumed_from_memory(lines: list[str]) -> list[int]:
    """The snapshot steps the run resumed from memory, in order."""
    return [int(match.group(1)) for line in lines
            if (match := re.match(r"recovery: the snapshot of step (\d+) is whole in memory; resuming from memory$", line))]


def _assert_at_most_one_step_redone(result: dict, resumed: int) -> None:
    """The fault came once step KILL_AT's snapshot was committed: the resume is from it or a newer
    one (one whose writes had all ended when the attempt ended is committed then, decision 207),
    and redoes at most one step that was done before the fault."""
    fault_at = result["events"][0]["at"]
    done_before = max(int(step) for step, at in result["step_times"].items() if at <= fault_at)
    assert KILL_AT <= resumed and done_before - resumed <= 1, (resumed, done_before)


@pytest.mark.slow
def test_a_rank_killed_resumes_from_memory_with_at_most_one_step_redone(tmp_path):
    result = _run(tmp_path, "rank")
    assert result["state"] == "finished"
    lines = _recovery_lines(result)
    [resumed] = _resumed_from_memory(lines)
    _assert_at_most_one_step_redone(result, resumed)
    assert any(line.startswith(f"loaded step {resumed}: ") and "from the snapshot in memory" in line for line in lines), lines
    assert {layout for layout in result["layouts"].values()} == {"dp=2,fsdp=1,tp=2,pp=1,vpp=1"}
    # Only the lost rank (and any peer stuck with it) got a new actor; one line says which (decision 149).
    [pool_line] = [line for line in result["log"] if line.startswith("recovery: ranks reused")]
    reused, restarted = re.match(r"recovery: ranks reused (\S+), restarted (\S+) ", pool_line).groups()
    numbers = lambda listed: [] if listed == "none" else [int(r) for r in listed.strip("[]").split(",")]  # noqa: E731
    assert numbers(restarted) and sorted(numbers(reused) + numbers(restarted)) == [0, 1, 2, 3], pool_line
    _assert_continues_the_reference(result)
    # The metrics and the store's note say which snapshot exists and where its copies live.
    assert result["snapshot_steps"][str(STEPS)] in (STEPS - 2, STEPS - 1)  # committed a step after it is taken
    assert result["snapshot_steps"][str(resumed + 1)] >= resumed  # the snapshot resumed from is named until a newer one
    assert len(result["snapshot_nodes"][str(STEPS)]) == 3
    assert result["snapshot_record"]["step"] >= 1 and len(result["snapshot_record"]["nodes"]) == 3


@pytest.mark.slow
def test_a_second_rank_killed_while_the_run_recovers_is_survived(tmp_path):
    """Issue 41 item 3: a second failure during recovery. The second kill lands once the rank
    pool has set up the recovery, before its first step; the run recovers again, from memory."""
    result = _run(tmp_path, "rank-twice")
    assert result["state"] == "finished"
    first, again = result["events"]
    assert again["at"] is not None and again["steps_before"] == 0, again  # it landed during the recovery
    failures = [entry for entry in result["history"] if entry["state"] == "restarting"]
    assert len(failures) == 2, result["history"]
    lines = _recovery_lines(result)
    resumed = _resumed_from_memory(lines)
    assert len(resumed) == 2 and resumed[0] >= KILL_AT, lines
    _assert_continues_the_reference(result)


@pytest.mark.slow
def test_a_node_removed_resumes_from_the_surviving_copies_on_three_ranks_of_another_layout(tmp_path):
    result = _run(tmp_path, "node")
    lines = _recovery_lines(result)
    [resumed] = _resumed_from_memory(lines)
    _assert_at_most_one_step_redone(result, resumed)
    before = {result["layouts"][str(step)] for step in range(1, resumed + 1)}
    after = {result["layouts"][str(step)] for step in range(resumed + 1, STEPS + 1)}
    assert len(after) == 1 and after != before
    assert "dp=3" in after.pop()  # 3 ranks left: the run was resharded from memory onto them
    _assert_continues_the_reference(result)


@pytest.mark.slow
def test_losing_both_holders_of_a_file_falls_back_and_says_so(tmp_path):
    result = _run(tmp_path, "both-holders")
    assert result["events"][0]["killed_keepers"] == 2
    lines = _recovery_lines(result)
    assert any((match := re.match(r"recovery: the snapshot of step (\d+) ", line)) and int(match.group(1)) >= KILL_AT
               and "resuming from the start" in line and "whole in memory" not in line for line in lines), lines
    assert not any("from the snapshot in memory" in line for line in lines)
    _assert_continues_the_reference(result)
