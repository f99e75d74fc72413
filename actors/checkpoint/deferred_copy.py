"""An async save's copy of what only the optimizer writes, deferred until just before its next step.

Between two optimizer steps nothing writes the parameters or the optimizer's state: forward and
backward only read them, gradients live elsewhere. So `rayshard.checkpoint.async_save(...,
optimizer=opt)` need not wait for their copy to host memory: it copies every other tensor of the
state dict at once (a buffer such as BatchNorm's running statistics, which a forward changes),
returns, and copies the optimizer's tensors in the background beside the next forward and
backward, while a step pre-hook on each optimizer holds its next `step()` until that copy is done.
The trainer's own async save overlaps its copy the same way (`async_save.py`).

Which tensors only the optimizer writes is read off the optimizer itself: a state-dict piece whose
memory is that of one of its parameters or state tensors (AdamW's moments and step) is deferred,
whatever view or DTensor shard the state dict holds of it. On a GPU the deferred copy runs on a
side stream that waits for the work queued before the call (an event recorded then), not for the
forward queued after it.

Each optimizer gets one step pre-hook, the first time it is passed, and keeps it: the hook waits
for that optimizer's copy in flight, if any, and is free otherwise. Adding or removing a hook per
save would change the optimizer's dict of hooks, which `step()` iterates, whenever a save was
asked for from another thread or from inside a hook. What is out of reach of a pre-hook is not
covered: a step replayed from a CUDA graph runs no Python, and pre-hooks registered before ours
(global ones included) run before it waits.
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from rayshard.actors.checkpoint.staging import HostStaging
from rayshard.actors.parallel.shards import local_tensor
from rayshard.plans.errors import CheckpointError


def optimizers_of(optimizer) -> list[torch.optim.Optimizer]:
    """`optimizer=` as a list: one optimizer, several, or None (no deferral)."""
    if optimizer is None:
        return []
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for each in optimizers:
        if not isinstance(each, torch.optim.Optimizer):
            raise CheckpointError(f"optimizer= takes a torch.optim.Optimizer (or a list of them), not a "
                                  f"{type(each).__name__}. Fix: pass the optimizer whose step() comes next")
        if not getattr(type(each).step, "hooked", False):  # torch wraps step() in Optimizer.__init__
            raise CheckpointError(f"optimizer= got a {type(each).__name__} whose step() runs no step pre-hooks (it did "
                                  "not run torch.optim.Optimizer.__init__), so its next step could not wait for the "
                                  "copy. Fix: leave optimizer= out (the save then copies everything before returning)")
    return optimizers


def _memory_of(tensor: torch.Tensor) -> tuple | None:
    """(device, storage address), or None for a tensor whose memory is not a storage of its own
    (a wrapper subclass: a quantized or float8 tensor), which is then copied before the call returns."""
    local = local_tensor(tensor)
    try:
        return local.device, local.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def written_by(optimizers: Iterable[torch.optim.Optimizer]) -> set[tuple]:
    """The memory (device, storage) of every parameter and state tensor of `optimizers`."""
    memory = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                memory.add(_memory_of(parameter))
                for value in optimizer.state.get(parameter, {}).values():
                    if isinstance(value, torch.Tensor):
                        memory.add(_memory_of(value))
    memory.discard(None)
    return memory


def is_written_by(tensor: torch.Tensor, memory: set[tuple]) -> bool:
    found = _memory_of(tensor)
    return found is not None and found in memory


@dataclass
class DeferredCopy:
    """The state-dict pieces (by index) copied in the background, and whether that is done."""

    indices: list[int]
    keys: list[Hashable]
    tensors: list[torch.Tensor]
    timeout_s: float
    events: dict = field(default_factory=dict)  # cuda device -> the event recorded when the save was asked for
    copied: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def of(cls, indices: list[int], keys: Sequence[Hashable], tensors: Sequence[torch.Tensor],
           timeout_s: float) -> "DeferredCopy":
        events = {}
        for device in {tensor.device for tensor in tensors if tensor.is_cuda}:
            events[device] = torch.cuda.current_stream(device).record_event()
        return cls(indices, list(keys), list(tensors), timeout_s, events)

    def run(self, staging: HostStaging, into: list) -> None:
        """Copy (on the saving thread) into `staging`, placing each copy at its index of `into`."""
        try:
            for index, copy in zip(self.indices, staging.copy(self.keys, self.tensors, after=self.events)):
                into[index] = copy
        finally:
            self.abandon()  # a failed copy fails the save, never the optimizer's wait

    def abandon(self) -> None:
        """Done, copied or not: the optimizer's step goes on, and the live tensors are let go of
        (an optimizer state replaced later is not kept alive by this save)."""
        self.tensors, self.events = [], {}
        self.copied.set()

    def wait(self) -> None:
        """Block until the copy is done, at most the checkpoint timeout."""
        if not self.copied.wait(self.timeout_s):
            raise CheckpointError(f"the async save's copy of the optimizer's tensors did not finish within "
                                  f"{self.timeout_s:g} s, so optimizer.step() cannot overwrite them safely. Fix: look "
                                  "for a stuck device copy; RAYSHARD_CHECKPOINT_TIMEOUT_S sets the bound")


class StepGates:
    """One step pre-hook per optimizer ever passed, kept, each waiting for that optimizer's copy
    in flight (none: it returns at once)."""

    def __init__(self):
        self._copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> DeferredCopy | None
        self._lock = threading.Lock()

    def hold(self, optimizers: Iterable[torch.optim.Optimizer], copy: DeferredCopy) -> None:
        for optimizer in optimizers:
            with self._lock:
                new = optimizer not in self._copies
                self._copies[optimizer] = copy
            if new:
                optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer, args, kwargs) -> None:  # (returning anything but None would replace step's arguments)
        with self._lock:
            copy = self._copies.get(optimizer)
        if copy is not None:
            copy.wait()
            with self._lock:
                if self._copies.get(optimizer) is copy:  # (not a newer save's, held meanwhile from another thread)
                    self._copies[optimizer] = None

    def forget(self) -> None:
        """The copies are over (the save in flight has ended) or not ours (a forked child's)."""
        with self._lock:
            for optimizer in list(self._copies):
                self._copies[optimizer] = None
