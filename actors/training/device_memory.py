"""What a rank says of its device each step: its name (the MFU table's key) and peak memory."""
from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

# Writing "5" here resets the process's resident-set high-water mark (VmHWM, which ru_maxrss
# reports) to its current resident set: Linux 4.0 and later, see proc(5). Cheap enough for every
# step (8 us measured): the kernel sets one counter and walks no page tables, unlike the other values.
_CLEAR_REFS = Path("/proc/self/clear_refs")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def reset_peak_memory(device: torch.device) -> bool:
    """Start the step's peak afresh: the CUDA allocator's own; on a CPU rank the kernel's
    high-water mark of the resident set. False where neither can be reset (a CPU rank off Linux,
    or a kernel that refuses): the peak then runs from the process's start."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True


def peak_memory_bytes(device: torch.device) -> int:
    """The CUDA allocator's peak since the last reset; on a CPU rank the process's peak resident
    set since the last reset (ru_maxrss: kibibytes on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def resident_memory_bytes() -> int:
    """The process's resident set now (Linux; 0 elsewhere): what a step's CPU peak starts from."""
    try:
        resident_pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident_pages * resource.getpagesize()
