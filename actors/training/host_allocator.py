"""A CPU rank keeps the host memory a step frees for the next step, instead of giving it back to
the OS and faulting it in again.

glibc's malloc serves a block above its mmap threshold (128 KiB, raised as blocks are freed, to at
most 32 MiB) with fresh pages and returns the heap's free top to the OS once it exceeds the trim
threshold (twice the mmap threshold). A training step frees its activations and gradients and
allocates the same sizes again the next step; whether a block then comes back or is faulted in
afresh depends on where small allocations happened to land between the large ones. A standalone
small-preset rank saw 752-8,176 minor page faults a step in fp32 and 17-30k in bf16 (its casts
are ~50 MB of fresh tensors a step): bf16 steps of 464-504 ms, against 446-457 ms with the
thresholds below and 0-128 faults a step; fp32 steps did not change measurably (docs/decisions.md 84).

The mmap threshold is fixed at 32 MiB, glibc's own ceiling for its dynamic threshold: blocks
larger than that (a checkpoint's staging buffers, a long sequence's activations) are still mapped
and returned, and still refaulted. The heap is trimmed only past 2 GiB of free top, so up to that
much of freed smaller blocks stays resident between steps: the step's working set, which the next
step needs again, but also whatever a save or load freed. PyTorch's CPU performance guide makes
the same point with tcmalloc or jemalloc.

Process-wide, and only where the C library has glibc's `mallopt` (elsewhere, a no-op).
"""
from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit, where glibc's dynamic threshold stops
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes an int


def keep_freed_host_memory() -> bool:
    """Set the two thresholds; True when the C library took both."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # this process's own C library
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
