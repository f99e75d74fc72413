"""Mixed precision: bf16 compute over float32 master state, one mechanism on every layout.

Where a rank shards or replicates data (dp or fsdp > 1) FSDP2's `MixedPrecisionPolicy` is the
peers' way (torchtitan): parameters are all-gathered in bf16, every op of the forward and backward
runs in bf16, gradients are cast to float32 before they are reduced, and the optimizer steps the
float32 shards. torchtitan switches to `torch.autocast` where FSDP does not apply (tp-only, one
rank); we make FSDP2's own casts there instead, so bf16 means the same numbers on every layout:
autocast keeps the embedding, norms and residual stream in float32 and would make a tp-only run
differ from an fsdp run by more than the layouts' own rounding (docs/decisions.md 57). Over one
data rank outside a pipeline the casts are made without FSDP2 (`parameter_casts.py`, decision
80: FSDP2's one-rank buffers cost a CPU step ~13%), bit-equal to FSDP2's; a one-rank pipeline
stage keeps FSDP2 over its one-rank mesh.

Activations and gradients between pipeline stages travel in the compute dtype (`compute_dtype`),
halving the bytes of every transfer. Loss and gradient norm stay float32 (`step_runner.py`,
`gradient_norm.clip_grad_norm`), and checkpoints hold only the float32 master state.
"""
from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype the forward and backward compute in (and stages exchange)."""
    return COMPUTE_DTYPES[precision]


def uses_fsdp(precision: str, data_parallel_size: int, pipeline: bool = False) -> bool:
    """FSDP2 wraps the model where data is split across ranks, and a bf16 pipeline stage always
    (its microbatches' gradients accumulate as FSDP2 accumulates them). A bf16 model over one
    data rank outside a pipeline gets FSDP2's casts without FSDP2 (`parameter_casts.py`)."""
    return data_parallel_size > 1 or (precision != "fp32" and pipeline)


def fsdp_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16 parameters in the forward and backward, float32 gradient reduction; fp32: no casts."""
    if precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=compute_dtype(precision), reduce_dtype=torch.float32)
