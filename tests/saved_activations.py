"""What autograd keeps for the backward: the bytes of the distinct storages a forward saves,
parameters left out. Inside a checkpointed block the checkpoint's own saved-tensors hooks take
over, so this counts only what is kept outside checkpointed regions: what activation
checkpointing and sequence parallelism are meant to shrink."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

# A DTensor's own shard, read without an autograd op (this runs inside a pack hook).
from rayshard.actors.parallel.shards import local_tensor as _local


class KeptBytes:
    def __init__(self, parameters: Iterable[torch.Tensor]):
        self.parameter_storages = {_local(parameter).untyped_storage().data_ptr() for parameter in parameters}
        self.storages: dict[int, int] = {}  # address -> bytes: each storage once (views share one)

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = _local(tensor)
        try:
            key, nbytes = local.untyped_storage().data_ptr(), local.untyped_storage().nbytes()
        except RuntimeError:  # a wrapper without storage of its own (a collective's pending result)
            key, nbytes = id(local), local.numel() * local.element_size()
        if key not in self.parameter_storages:
            self.storages[key] = nbytes
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


@contextmanager
def kept_for_backward(parameters: Iterable[torch.Tensor]) -> Iterator[KeptBytes]:
    """Counts, into the yielded record, what autograd saves while the block runs."""
    kept = KeptBytes(parameters)
    with torch.autograd.graph.saved_tensors_hooks(kept.pack, lambda tensor: tensor):
        yield kept
