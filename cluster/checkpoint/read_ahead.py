"""Lazy pieces loaded one ahead of the writer, in a background thread (decision 195).

A DCP import writes bands it produces lazily: `write_pieces` calls a piece's `load()`, writes the
tensor it returns, and only then calls the next piece's `load()`. Producing a band (memory maps
faulted in, qkv / gate_up gathered, or reads into buffers) and writing one (the kernel copying it
into the target's pages, the checksum) are independent, and each of them spends most of its time
outside the GIL, so on a machine with a core to spare, producing band k+1 while band k is written
hides the smaller of the two. (On the shared 2-core machine the process gets about one core and it
gained nothing while costing 8-13% more CPU, so the import leaves it off by default.) The bound stays one band ahead: band k+1 starts only once the writer has asked for band k
(so it is done with band k-1), so at most two bands are alive; a producer alternates between two
buffer sets by the band's parity (`slot`), which is then never one the writer still reads.

No unbounded wait: both sides wait in short slices and give up when the other side is gone (the
writer failed and closed the read-ahead, or the producer thread died); an error in a load reaches
the writer as the same exception, at the piece it belongs to.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from rayshard.plans.errors import CheckpointError

WAIT_SLICE_S = 0.5
Load = Callable[[int], torch.Tensor]  # (slot: the band's parity) -> the band


class ReadAhead:
    """`loads[k](k % 2)` run in order on one background thread, at most one ahead of `take(k)`.
    The consumer calls take(0), take(1), ... in order, and take(k) means it is done with every
    band before k."""

    def __init__(self, loads: Sequence[Load]):
        self._loads = list(loads)
        self._condition = threading.Condition()
        self._asked = -1  # the highest k the consumer has taken (or is waiting for)
        self._ready: dict[int, torch.Tensor] = {}
        self._failed: tuple[int, BaseException] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._produce, name="rayshard-read-ahead", daemon=True)
        self._torch_threads = torch.get_num_threads()  # the caller's setting (one_torch_thread) for the producer too

    def start(self) -> "ReadAhead":
        self._thread.start()
        return self

    def _produce(self) -> None:
        torch.set_num_threads(self._torch_threads)
        for k, load in enumerate(self._loads):
            with self._condition:
                while self._asked < k - 1 and not self._closed:  # band k-2 (same slot) still being written
                    self._condition.wait(WAIT_SLICE_S)
                if self._closed:
                    return
            try:
                band = load(k % 2)
            except BaseException as error:  # handed to the consumer at band k
                with self._condition:
                    self._failed = (k, error)
                    self._condition.notify_all()
                return
            with self._condition:
                self._ready[k] = band
                self._condition.notify_all()

    def take(self, k: int) -> torch.Tensor:
        with self._condition:
            self._asked = max(self._asked, k)
            self._condition.notify_all()
            while k not in self._ready:
                if self._failed is not None and self._failed[0] <= k:
                    raise self._failed[1]
                if self._closed:
                    raise CheckpointError("the import's read-ahead was closed while a band was still wanted")
                if not self._thread.is_alive():
                    raise CheckpointError(f"the import's read-ahead thread stopped before band {k} (an internal error); "
                                          "import without RAYSHARD_DCP_IMPORT_READ_AHEAD=1")
                self._condition.wait(WAIT_SLICE_S)
            return self._ready.pop(k)

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._ready.clear()
            self._condition.notify_all()
        if self._thread.is_alive():
            self._thread.join()  # a band in production finishes first: a few MiB of copies, bounded


@contextmanager
def reading_ahead(loads: Sequence[Load]) -> Iterator[list[Callable[[], torch.Tensor]]]:
    """The loads as argument-free callables for `LazyTensor`s, served by a ReadAhead running while
    the context is open (closed, its thread joined, on leaving it, also on an error)."""
    ahead = ReadAhead(loads).start()
    try:
        yield [lambda k=k: ahead.take(k) for k in range(len(loads))]
    finally:
        ahead.close()
