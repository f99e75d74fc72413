"""What a rank says of its device each step: its name (the MFU table's key) and peak memory."""
from __future__ import annotations

import resource
import sys

import torch


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def reset_peak_memory(device: torch.device) -> None:
    """Start the step's peak afresh (the CUDA allocator keeps one; the OS's CPU peak cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int:
    """The CUDA allocator's peak since the step began; on a CPU rank the process's peak resident
    set so far (ru_maxrss: kibibytes on Linux, bytes on macOS)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
