"""Failure and scaling policies: pure decisions over what the controller observed.

Kept free of Ray and clocks so every decision is a unit test: the controller feeds in counts
and sizes, and acts on what comes back.
"""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    wait_s: float
    reason: str


@dataclass(frozen=True)
class FailurePolicy:
    """Retry up to max_failures times, waiting backoff_s * factor**(n-1) (capped) before each."""

    max_failures: int = 3
    backoff_s: float = 1.0
    backoff_factor: float = 2.0
    max_backoff_s: float = 60.0

    def __post_init__(self):
        if self.max_failures < 0:
            raise ConfigError("max_failures", self.max_failures, "must be >= 0", "use 0 to fail on the first error")

    def after_failure(self, failures: int) -> RetryDecision:
        """failures: how many have happened, this one included."""
        if failures > self.max_failures:
            return RetryDecision(False, 0.0, f"{failures} failures exceed max_failures={self.max_failures}")
        wait = min(self.max_backoff_s, self.backoff_s * self.backoff_factor ** (failures - 1))
        return RetryDecision(True, wait, f"failure {failures} of at most {self.max_failures}: restarting in {wait:.1f}s")


@dataclass(frozen=True)
class ScalingPolicy:
    """Run on between min_ranks and max_ranks ranks (None: as many as there are)."""

    min_ranks: int = 1
    max_ranks: int | None = None

    def __post_init__(self):
        if self.min_ranks < 1 or (self.max_ranks is not None and self.max_ranks < self.min_ranks):
            raise ConfigError("min_ranks/max_ranks", (self.min_ranks, self.max_ranks),
                              "need 1 <= min_ranks <= max_ranks", "adjust --min-ranks/--max-ranks")

    def ranks_to_use(self, available: int) -> int | None:
        """How many ranks to start with `available`; None when fewer than min_ranks exist."""
        if available < self.min_ranks:
            return None
        return available if self.max_ranks is None else min(available, self.max_ranks)

    def should_grow(self, running: int, available: int) -> bool:
        """Resize (at the next checkpoint) when more ranks than the running layout uses could
        be used. `running` is the world size of the current layout."""
        target = self.ranks_to_use(available)
        return target is not None and target > running
