"""bf16 over a one-rank data mesh: the casts FSDP2's `MixedPrecisionPolicy` makes, without FSDP2.

Decision 57 wants bf16 to mean the same numbers on every layout, so a one-rank data mesh (one
rank, tp-only) computes what FSDP2 with `param_dtype=bfloat16, reduce_dtype=float32`
computes there. Over one rank FSDP2's collectives move nothing, but its buffers still cost: each
step it copies every block's bf16 parameters out of the all-gather buffer into freshly allocated
storage, and every float32 gradient from the reduce-scatter input into a fresh output; on a CPU
that was ~90 ms of a 700 ms small-preset step, mostly first-touch page faults (decision 80). This
makes the same casts directly:

- before each unit's forward (each block, then the root for the parameters outside blocks, as
  `fully_shard` groups them) its float32 parameters are cast to bf16 through autograd and the
  module reads the casts; the floating-point inputs of the unit are cast too
  (`cast_forward_inputs`);
- the backward of the cast turns each bf16 gradient into float32 and accumulates it into the
  float32 parameter's `.grad`: FSDP2's float32 reduction over one rank, the same values.

The casts shadow the parameters in the module's instance `__dict__` (attribute lookup finds them
before nn.Module's `_parameters`), so `parameters()`, `state_dict()`, the optimizer and
checkpoints see only the float32 masters. They are recast at every forward of their unit, which
an activation-checkpointing recompute is not (it reads the casts of its forward), and dropped at
the end of the backward, or right after a forward without gradients.
`tests/integration/test_parameter_casts.py` checks losses, gradient norms and parameters
bit-equal to FSDP2's.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
from torch.distributed.utils import _apply_to_tensors


class ParameterCasts:
    """Casts the parameters of `units` (modules, the root last; a parameter belongs to the first
    unit that holds it, a later unit holding only the rest, as FSDP2's nested `fully_shard` does)
    to `dtype` at each unit's forward. `ignored`: parameters left alone (experts that cast
    themselves)."""

    def __init__(self, units: list[nn.Module], dtype: torch.dtype, ignored: set[nn.Parameter] = frozenset()):
        self.dtype = dtype
        # FSDP2's own input cast (`cast_forward_inputs`): floating-point tensors to dtype, the rest as
        # they are; its function (private, torch is pinned), so the rule cannot drift from the one
        # it stands in for.
        self._cast_input = functools.partial(_cast_fp_tensor, dtype)
        self._live: set[tuple[nn.Module, str]] = set()  # (module, attribute) shadowed now
        self._drop_queued = False
        claimed: set[nn.Parameter] = set(ignored)
        for unit in units:
            # (module, attribute) pairs, not the parameters: a model built on the meta device gets
            # new Parameter objects from `to_empty` after this, so each forward reads them afresh.
            # Every pair of the unit's own parameters, twice for a tied one (the embedding and the
            # LM head): both modules must read the cast.
            mine = {param for module in unit.modules() for param in module._parameters.values()
                    if param is not None and param not in claimed}
            owners = [(module, name) for module in unit.modules()
                      for name, param in module._parameters.items() if param in mine]
            claimed |= mine
            unit.register_forward_pre_hook(self._pre_forward_hook(owners, unit is units[-1]), with_kwargs=True)
        # The root's forward ends last (its own units' forwards run inside it).
        units[-1].register_forward_hook(self._post_forward)

    def _pre_forward_hook(self, owners: list[tuple[nn.Module, str]], root: bool):
        def pre_forward(unit: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if root:  # a new forward: its backward queues its own drop (a failed one never ran it)
                self._drop_queued = False
            casts: dict[nn.Parameter, torch.Tensor] = {}
            for module, name in owners:
                param = module._parameters[name]
                if param not in casts:  # one cast for a parameter two modules share (tied embeddings)
                    casts[param] = param.to(self.dtype)
                    if casts[param] is not param and casts[param].requires_grad:  # (a master already in dtype: itself)
                        casts[param].register_hook(self._queue_drop)
                module.__dict__[name] = casts[param]
                self._live.add((module, name))
            return _apply_to_tensors(self._cast_input, args), _apply_to_tensors(self._cast_input, kwargs)
        return pre_forward

    def _post_forward(self, unit: nn.Module, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled():  # no backward will come to drop them
            self.drop()

    def _queue_drop(self, grad: torch.Tensor) -> None:
        # Called in the backward; the engine runs the callback once the whole backward is done.
        if not self._drop_queued:
            self._drop_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.drop)

    def drop(self) -> None:
        """Unshadow every parameter: modules read their float32 masters again."""
        for module, name in self._live:
            module.__dict__.pop(name, None)
        self._live.clear()
        self._drop_queued = False


def cast_parameters(model: nn.Module, dtype: torch.dtype, blocks_attr: str = "layers",
                    ignored: list[nn.Parameter] | None = None) -> ParameterCasts:
    """Per block, then the root: the units `apply_data_parallel` gives FSDP2."""
    blocks = list(getattr(model, blocks_attr, {}).values())
    return ParameterCasts([*blocks, model], dtype, set(ignored or ()))
