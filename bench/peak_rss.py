"""Peak resident memory while a block runs: the benches' memory figure (one sampler for all)."""
from __future__ import annotations

import threading

from rayshard.actors.training.device_memory import resident_memory_bytes


class PeakRSS:
    """Largest resident set above the starting one while the block runs (sampled every 2 ms)."""

    def __enter__(self):
        self.base = self.peak = resident_memory_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, resident_memory_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, resident_memory_bytes())

    @property
    def above_base(self) -> int:
        return self.peak - self.base
