"""The elastic training controller: a small state machine around a worker group.

    SCHEDULING -> RUNNING -> FINISHED
                    |  failure -> RESTARTING -> SCHEDULING (resume from LATEST, replanned layout)
                    |  more resources at a checkpoint -> RESIZING -> SCHEDULING
                    |  failures exhausted, or too few ranks for too long -> ERRORED

Decisions come from pure policies (plans/elastic.py) and the layout chooser
(plans/layout/chooser.py); side effects live in the worker group, which tests replace with a
fake that scripts failures and resource changes (as Ray Train v2's controller tests do).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

from rayshard.plans.elastic import FailurePolicy, ScalingPolicy
from rayshard.plans.layout.parallel_layout import ParallelLayout


class State(str, enum.Enum):
    SCHEDULING = "scheduling"
    RUNNING = "running"
    RESTARTING = "restarting"
    RESIZING = "resizing"
    FINISHED = "finished"
    ERRORED = "errored"


class Outcome(str, enum.Enum):
    FINISHED = "finished"
    FAILED = "failed"
    RESIZE = "resize"  # stopped cleanly right after a committed checkpoint, to grow


@dataclass
class RunResult:
    outcome: Outcome
    error: BaseException | None = None
    detail: str = ""


class WorkerGroup(Protocol):
    def available_ranks(self) -> int: ...

    # Optional: capacity() -> str, what the cluster offers and why ("2 ranks (2 CPUs / 1 CPU per
    # rank)"), named in the controller's messages while it waits.

    def run(self, layout: ParallelLayout, should_resize: Callable[[], bool]) -> RunResult:
        """Start ranks on `layout`, resume from the latest checkpoint if any, train until done,
        a failure, or should_resize() says so after a checkpoint; always tear down."""
        ...


@dataclass
class Transition:
    state: State
    detail: str
    at: float  # the controller's clock (monotonic)
    at_wall: float  # unix time, to line up with logs and metrics


@dataclass
class Controller:
    group: WorkerGroup
    # ranks -> layout: a ParallelLayout, or a LayoutChoice whose explanation gets logged
    choose: Callable[[int], object]
    failure_policy: FailurePolicy = field(default_factory=FailurePolicy)
    scaling_policy: ScalingPolicy = field(default_factory=ScalingPolicy)
    wait_for_ranks_s: float = 300.0
    poll_s: float = 2.0
    sleep: Callable[[float], None] = time.sleep
    clock: Callable[[], float] = time.monotonic
    log: Callable[[str], None] = print

    def __post_init__(self):
        self.state = State.SCHEDULING
        self.failures = 0
        self.layout: ParallelLayout | None = None
        self.history: list[Transition] = []
        self.last_error: BaseException | None = None
        self._waiting_since: float | None = None

    def _enter(self, state: State, detail: str) -> None:
        self.state = state
        self.history.append(Transition(state, detail, self.clock(), time.time()))
        self.log(f"[controller] {state.value}: {detail}")

    def step(self) -> State:
        """One transition; returns the new state."""
        if self.state in (State.SCHEDULING,):
            self._schedule()
        elif self.state is State.RUNNING:
            self._run()
        elif self.state in (State.RESTARTING, State.RESIZING):
            self._enter(State.SCHEDULING, "replanning the layout for the ranks available now")
        return self.state

    def run(self) -> State:
        while self.state not in (State.FINISHED, State.ERRORED):
            self.step()
        return self.state

    def _schedule(self) -> None:
        available = self.group.available_ranks()
        ranks = self.scaling_policy.ranks_to_use(available)
        if ranks is None:
            offered = self._capacity() or f"{available} ranks"
            if self._waiting_since is None:  # never wait silently: say what for, and how long at most
                self._waiting_since = self.clock()
                self.log(f"[controller] waiting up to {self.wait_for_ranks_s:.0f}s for min_ranks="
                         f"{self.scaling_policy.min_ranks}: the cluster offers {offered}")
            if self.clock() - self._waiting_since > self.wait_for_ranks_s:
                self._enter(State.ERRORED, f"only {offered} available for {self.wait_for_ranks_s:.0f}s; "
                                           f"min_ranks={self.scaling_policy.min_ranks}. Fix: add nodes, lower "
                                           "--min-ranks, or lower --cpus-per-rank")
                return
            self.sleep(self.poll_s)
            return
        self._waiting_since = None
        choice = self.choose(ranks)
        self.layout = getattr(choice, "layout", choice)
        if hasattr(choice, "explain"):
            self.log("[controller] layout choice:\n  " + choice.explain().replace("\n", "\n  "))
        self._enter(State.RUNNING, f"{available} ranks available, running {self.layout.describe()} "
                                   f"on {self.layout.world_size}")

    def _capacity(self) -> str:
        """The worker group's own account of what the cluster offers, where it gives one."""
        describe = getattr(self.group, "capacity", None)
        return describe() if callable(describe) else ""

    def _should_grow(self, layout: ParallelLayout) -> bool:
        """More ranks are usable than the running layout uses, and the layout chooser would
        actually use them (6 ranks may still mean a 4-rank layout: then there is nothing to gain)."""
        available = self.group.available_ranks()
        if not self.scaling_policy.should_grow(layout.world_size, available):
            return False
        choice = self.choose(self.scaling_policy.ranks_to_use(available))
        return getattr(choice, "layout", choice).world_size > layout.world_size

    def _run(self) -> None:
        layout = self.layout
        result = self.group.run(layout, lambda: self._should_grow(layout))
        if result.outcome is Outcome.FINISHED:
            self._enter(State.FINISHED, result.detail or "training complete")
        elif result.outcome is Outcome.RESIZE:
            self._enter(State.RESIZING, result.detail or "more ranks available: resizing at the checkpoint just committed")
        else:
            self.failures += 1
            self.last_error = result.error
            decision = self.failure_policy.after_failure(self.failures)
            if not decision.retry:
                self._enter(State.ERRORED, f"{decision.reason}; last error: {result.error}")
                return
            self._enter(State.RESTARTING, f"{decision.reason}; error: {result.error}")
            self.sleep(decision.wait_s)
