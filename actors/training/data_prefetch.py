"""Batches of the next few steps fetched in one background thread while the current step trains.

Memory stays bounded: at most `depth` batches ahead are held. A step's batch is a pure function of
the step, so a prefetched batch is exactly what a synchronous read would return.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

from rayshard.plans.errors import RayshardError

Batch = TypeVar("Batch")


class StepPrefetcher(Generic[Batch]):
    def __init__(self, fetch: Callable[[int], Batch], depth: int, timeout_s: float, what: str):
        self.fetch, self.depth, self.timeout_s, self.what = fetch, depth, timeout_s, what
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayshard-data")
        self.pending: dict[int, Future] = {}

    def get(self, step: int) -> Batch:
        future = self.pending.pop(step, None) or self.executor.submit(self.fetch, step)
        for stale in [s for s in self.pending if not step < s <= step + self.depth]:
            self.pending.pop(stale).cancel()
        for ahead in range(step + 1, step + 1 + self.depth):
            if ahead not in self.pending:
                self.pending[ahead] = self.executor.submit(self.fetch, ahead)
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RayshardError(f"reading step {step}'s batch from {self.what} took over {self.timeout_s:g} s. "
                                "Fix: check the store and network (RAYSHARD_S3_* timeouts), or raise "
                                "data.read_timeout_s") from None

    def close(self) -> None:
        for future in self.pending.values():
            future.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
