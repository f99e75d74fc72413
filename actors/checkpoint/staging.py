"""Host memory an asynchronous save copies a rank's state into, kept from one save to the next.

Both asynchronous saves use it: the trainer's (`async_save.py`, whose copy overlaps the next
forward and backward) and `rayshard.checkpoint.async_save` (whose caller waits for the copy, or,
given the optimizer, only for the tensors the optimizer does not write: `deferred_copy.py`).
Buffers are kept between saves, so the next copy has no allocation or page faults; on a GPU they
are pinned and the copy runs on a side stream. The owner must not stage again while a previous
save still reads the buffers.
"""
from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import torch


class HostStaging:
    def __init__(self):
        self._buffers: dict[Hashable, torch.Tensor] = {}

    def _buffer(self, key: Hashable, tensor: torch.Tensor) -> torch.Tensor:
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=tensor.is_cuda)
            self._buffers[key] = buffer
        return buffer

    def keep_only(self, keys: Sequence[Hashable]) -> None:
        """Forget the buffers of pieces no longer saved (another model or layout since the last save)."""
        for stale in set(self._buffers) - set(keys):
            del self._buffers[stale]

    def copy(self, keys: Sequence[Hashable], tensors: Sequence[torch.Tensor],
             after: Mapping | None = None) -> list[torch.Tensor]:
        """Host copies of `tensors`, complete when this returns. after: a CUDA event per device the
        copy waits for (recorded when the save was asked for, on another thread); else it waits
        for everything queued on the device's default stream."""
        devices = {tensor.device for tensor in tensors if tensor.is_cuda}
        streams = {device: torch.cuda.Stream(device) for device in devices}
        for device, stream in streams.items():  # the copy reads what the last optimizer step wrote
            if after and device in after:
                stream.wait_event(after[device])
            else:
                stream.wait_stream(torch.cuda.default_stream(device))
        copies = []
        for key, tensor in zip(keys, tensors):
            buffer = self._buffer(key, tensor)
            if tensor.is_cuda:
                with torch.cuda.stream(streams[tensor.device]):
                    buffer.copy_(tensor.detach(), non_blocking=True)
            else:
                buffer.copy_(tensor.detach())
            copies.append(buffer)
        for stream in streams.values():
            stream.synchronize()
        return copies
