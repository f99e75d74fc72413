"""The DCP import's read-ahead (decision 195): bands produced on a background thread at most one
ahead of the writer, in alternating buffer sets, errors handed to the writer at their band, and
nothing left running when the writer stops early."""
from __future__ import annotations

import threading

import pytest
import torch

from rayshard.cluster.checkpoint.read_ahead import ReadAhead, reading_ahead
from rayshard.plans.errors import CheckpointError


def test_bands_come_in_order_at_most_one_ahead_of_the_writer_in_alternating_slots():
    taken = []  # what the writer has asked for, in order
    started = []  # (band, slot, how many the writer had asked for when it started)
    lock = threading.Lock()

    def load(k):
        def run(slot):
            with lock:
                started.append((k, slot, len(taken), threading.current_thread().name))
            return torch.full((3,), k)
        return run
    with reading_ahead([load(k) for k in range(7)]) as loads:
        for k, band in enumerate(loads):
            with lock:
                taken.append(k)
            assert band().tolist() == [k] * 3
    assert [k for k, *_ in started] == list(range(7))
    for k, slot, asked, thread in started:
        assert slot == k % 2
        assert asked >= k  # band k starts only once the writer asked for k-1: it is done with k-2, the same slot
        assert thread == "rayshard-read-ahead"


def test_an_error_in_a_band_reaches_the_writer_at_that_band():
    def load(k):
        def run(slot):
            if k == 2:
                raise CheckpointError("band 2: the file is truncated")
            return torch.zeros(1)
        return run
    ahead = ReadAhead([load(k) for k in range(5)]).start()
    try:
        ahead.take(0)
        ahead.take(1)
        with pytest.raises(CheckpointError, match="band 2: the file is truncated"):
            ahead.take(2)
    finally:
        ahead.close()
    assert not ahead._thread.is_alive()


def test_a_writer_that_stops_early_leaves_no_thread_and_no_band_produced_beyond_one_ahead():
    produced = []

    def load(k):
        def run(slot):
            produced.append(k)
            return torch.zeros(1)
        return run
    with pytest.raises(RuntimeError, match="the write failed"):
        with reading_ahead([load(k) for k in range(50)]) as loads:
            loads[0]()
            raise RuntimeError("the write failed")
    assert not [t for t in threading.enumerate() if t.name == "rayshard-read-ahead"]
    assert produced in ([0], [0, 1])
