"""A CPU rank keeps the host memory a step frees for the next step, instead of giving it back to
the OS and faulting it in again.

glibc's malloc serves a block above its mmap threshold (128 KiB, raised as blocks are freed, to at
most 32 MiB) with fresh pages and returns the heap's free top to the OS once it exceeds the trim
threshold (twice the mmap threshold). A training step frees its activations and gradients and
allocates the same sizes again the next step, so with those defaults every step faulted tens of
MiB of fresh, zeroed pages back in: on the small preset, one rank, fp32, a median of ~12k minor
page faults a step inside the forward and backward, 60-85 ms of a ~950 ms step on the 2-core VM
(docs/decisions.md 84). With the mmap threshold fixed at glibc's maximum (32 MiB) and the heap
trimmed only past 2 GiB of free top, a step reuses the previous step's pages: 0-4 faults a step.
Blocks over 32 MiB (a checkpoint's staging buffers) are still mapped and unmapped, so one-off
large buffers do not stay resident; what stays is the step's own working set, which the next
step needs again. PyTorch's CPU performance guide gives the same advice (tcmalloc or jemalloc).

Process-wide, and only where the C library has glibc's `mallopt` (elsewhere, a no-op).
"""
from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1  # glibc's malloc.h
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit); mallopt refuses more
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # mallopt takes an int


def keep_freed_host_memory() -> bool:
    """Set the two thresholds; True when the C library took both."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # this process's own C library
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
