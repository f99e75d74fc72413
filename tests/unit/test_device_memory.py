"""A CPU rank's per-step peak memory: the kernel's high-water mark of the resident set, reset as
each step begins, so a step reports its own peak rather than the largest since the rank started."""
from __future__ import annotations

import mmap
import os
import sys
from pathlib import Path

import pytest
import torch

from rayshard.actors.training.device_memory import peak_memory_bytes, reset_peak_memory, resident_memory_bytes

CPU = torch.device("cpu")


CLEAR_REFS = Path("/proc/self/clear_refs")


def _fresh_pages(nbytes: int) -> mmap.mmap:
    """nbytes of new resident memory: an anonymous mapping with each page written. Not a
    bytearray: late in a long test run the allocator can hand back heap pages that are already
    resident, and the resident set (and its mark) would not move."""
    pages = mmap.mmap(-1, nbytes)
    for offset in range(0, nbytes, mmap.PAGESIZE):
        pages[offset] = 1
    return pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident set's high-water mark is reset through Linux's /proc")
@pytest.mark.skipif(not os.access(CLEAR_REFS, os.W_OK), reason="this kernel or sandbox offers no writable clear_refs")
def test_a_reset_drops_an_earlier_peak_and_a_later_one_counts():
    block = 256 << 20  # above any malloc mmap threshold: given back to the OS when freed
    touched = _fresh_pages(block)
    touched.close()
    earlier_peak = peak_memory_bytes(CPU)
    assert earlier_peak >= resident_memory_bytes() + block // 2

    assert reset_peak_memory(CPU)
    after_reset = peak_memory_bytes(CPU)
    assert after_reset < earlier_peak - block // 2
    assert after_reset >= resident_memory_bytes() - (8 << 20)  # the mark starts again at the resident set

    touched = _fresh_pages(block // 2)
    assert peak_memory_bytes(CPU) >= after_reset + block // 4
    touched.close()
