"""The controller's state machine stepped against a fake worker group (no Ray)."""
import pytest

from rayshard.cluster.run.controller import Controller, Outcome, RunResult, State
from rayshard.plans.elastic import FailurePolicy, ScalingPolicy
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout


class FakeGroup:
    """Scripted: `ranks` is what the cluster has now; each run pops the next scripted outcome."""

    def __init__(self, ranks, outcomes, on_run=None):
        self.ranks, self.outcomes, self.on_run, self.runs = ranks, list(outcomes), on_run, []

    def available_ranks(self):
        return self.ranks

    def run(self, layout, should_resize):
        self.runs.append(layout)
        if self.on_run:
            self.on_run(self, len(self.runs))
        outcome = self.outcomes.pop(0)
        if outcome == "check-resize":
            return RunResult(Outcome.RESIZE) if should_resize() else RunResult(Outcome.FINISHED)
        return outcome


def _controller(group, **kwargs):
    waits = []
    controller = Controller(group, choose=lambda n: ParallelLayout(dp=n), sleep=waits.append, log=lambda m: None, **kwargs)
    return controller, waits


def test_finishes_on_the_available_ranks():
    group = FakeGroup(4, [RunResult(Outcome.FINISHED)])
    controller, _ = _controller(group)
    assert controller.run() is State.FINISHED
    assert group.runs == [ParallelLayout(dp=4)]
    assert [t.state for t in controller.history] == [State.RUNNING, State.FINISHED]


def test_failure_restarts_on_what_remains_with_backoff():
    def lose_a_rank(group, run_number):
        if run_number == 1:
            group.ranks = 3
    group = FakeGroup(4, [RunResult(Outcome.FAILED, RuntimeError("rank 2 died")), RunResult(Outcome.FINISHED)], lose_a_rank)
    controller, waits = _controller(group, failure_policy=FailurePolicy(max_failures=2, backoff_s=1.5))
    assert controller.run() is State.FINISHED
    assert group.runs == [ParallelLayout(dp=4), ParallelLayout(dp=3)]
    assert waits == [1.5]
    assert [t.state for t in controller.history] == [State.RUNNING, State.RESTARTING, State.SCHEDULING,
                                                     State.RUNNING, State.FINISHED]


def test_too_many_failures_end_in_errored_with_the_last_error():
    failed = [RunResult(Outcome.FAILED, RuntimeError(f"boom {i}")) for i in range(3)]
    controller, waits = _controller(FakeGroup(2, failed), failure_policy=FailurePolicy(max_failures=2, backoff_s=1, backoff_factor=3))
    assert controller.run() is State.ERRORED
    assert waits == [1, 3]
    assert "boom 2" in controller.history[-1].detail and "exceed max_failures=2" in controller.history[-1].detail


def test_growth_resizes_at_a_checkpoint_within_max_ranks():
    def grow(group, run_number):
        if run_number == 1:
            group.ranks = 8
    group = FakeGroup(2, ["check-resize", "check-resize"], grow)
    controller, _ = _controller(group, scaling_policy=ScalingPolicy(min_ranks=2, max_ranks=6))
    assert controller.run() is State.FINISHED
    assert group.runs == [ParallelLayout(dp=2), ParallelLayout(dp=6)]
    assert State.RESIZING in [t.state for t in controller.history]


def test_waits_for_min_ranks_then_gives_up():
    now = [0.0]
    group = FakeGroup(1, [])
    controller = Controller(group, choose=lambda n: ParallelLayout(dp=n), scaling_policy=ScalingPolicy(min_ranks=2),
                            wait_for_ranks_s=10, poll_s=4, sleep=lambda s: now.__setitem__(0, now[0] + s),
                            clock=lambda: now[0], log=lambda m: None)
    assert controller.run() is State.ERRORED
    assert "min_ranks=2" in controller.history[-1].detail and now[0] >= 10


def test_policies_are_pure_and_validated():
    policy = FailurePolicy(max_failures=3, backoff_s=2, backoff_factor=2, max_backoff_s=5)
    assert [policy.after_failure(n).wait_s for n in (1, 2, 3)] == [2, 4, 5]
    assert not policy.after_failure(4).retry
    scaling = ScalingPolicy(min_ranks=2, max_ranks=4)
    assert (scaling.ranks_to_use(1), scaling.ranks_to_use(3), scaling.ranks_to_use(9)) == (None, 3, 4)
    assert scaling.should_grow(2, 3) and not scaling.should_grow(4, 9)
    with pytest.raises(ConfigError):
        ScalingPolicy(min_ranks=4, max_ranks=2)


def test_waiting_for_ranks_is_announced_with_what_the_cluster_offers():
    now, logs = [0.0], []
    group = FakeGroup(1, [])
    group.capacity = lambda: "1 ranks (1 CPUs / 1 CPU per rank)"
    controller = Controller(group, choose=lambda n: ParallelLayout(dp=n), scaling_policy=ScalingPolicy(min_ranks=2),
                            wait_for_ranks_s=10, poll_s=4, sleep=lambda s: now.__setitem__(0, now[0] + s),
                            clock=lambda: now[0], log=logs.append)
    assert controller.run() is State.ERRORED
    waiting = [line for line in logs if "waiting up to 10s for min_ranks=2" in line]
    assert len(waiting) == 1 and "the cluster offers 1 ranks (1 CPUs / 1 CPU per rank)" in waiting[0]
    assert "1 CPU per rank" in controller.history[-1].detail and "Fix:" in controller.history[-1].detail
