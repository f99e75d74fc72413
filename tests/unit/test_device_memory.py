"""A CPU rank's per-step peak memory: the kernel's high-water mark of the resident set, reset as
each step begins, so a step reports its own peak rather than the largest since the rank started."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from rayshard.actors.training.device_memory import peak_memory_bytes, reset_peak_memory, resident_memory_bytes

CPU = torch.device("cpu")


CLEAR_REFS = Path("/proc/self/clear_refs")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the resident set's high-water mark is reset through Linux's /proc")
@pytest.mark.skipif(not os.access(CLEAR_REFS, os.W_OK), reason="this kernel or sandbox offers no writable clear_refs")
def test_a_reset_drops_an_earlier_peak_and_a_later_one_counts():
    block = 256 << 20  # above any malloc mmap threshold: given back to the OS when freed
    touched = bytearray(block)
    touched[::4096] = b"\x01" * len(touched[::4096])  # write each page: resident
    del touched
    earlier_peak = peak_memory_bytes(CPU)
    assert earlier_peak >= resident_memory_bytes() + block // 2

    assert reset_peak_memory(CPU)
    after_reset = peak_memory_bytes(CPU)
    assert after_reset < earlier_peak - block // 2
    assert after_reset >= resident_memory_bytes() - (8 << 20)  # the mark starts again at the resident set

    touched = bytearray(block // 2)
    touched[::4096] = b"\x02" * len(touched[::4096])
    assert peak_memory_bytes(CPU) >= after_reset + block // 4
    del touched
