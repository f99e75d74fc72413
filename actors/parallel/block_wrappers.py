"""Activation checkpointing and torch.compile, applied per transformer block from outside.

The block's `forward` is replaced on the instance (a checkpointed and/or compiled version of
itself), not wrapped in another module: `checkpoint_wrapper` and `torch.compile(module)` insert
`_checkpoint_wrapped_module.` / `_orig_mod.` into every parameter name, and rayshard's
checkpoints are keyed by global parameter names. FSDP2's and TP's hooks stay on the block module,
outside the checkpointed and compiled region, the order torchtitan applies them in
(TP -> AC -> compile -> FSDP).

Selective AC follows torchtitan's op-level policy: the outputs of matmuls, attention and
collectives are saved, everything else (norms, activations, RoPE, elementwise ops) is recomputed
in the backward; full AC keeps only each block's input.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# Ops whose outputs selective AC keeps: expensive to recompute (matmuls, attention) or a collective
# (recomputing would communicate again). Names that a torch build lacks are skipped.
_SAVED_OP_NAMES = (
    "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.all_reduce.default", "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.all_to_all_single.default",
)


def _op(qualified: str):
    namespace, name, overload = qualified.split(".")
    packet = getattr(getattr(torch.ops, namespace), name, None)
    return getattr(packet, overload, None) if packet is not None else None


SAVED_OPS = frozenset(op for op in map(_op, _SAVED_OP_NAMES) if op is not None)


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(forward: Callable, ac: str) -> Callable:
    """`forward` under non-reentrant activation checkpointing ("full" or "selective")."""
    if ac == "full":
        return functools.partial(checkpoint, forward, use_reentrant=False)
    if ac == "selective":
        context = functools.partial(create_selective_checkpoint_contexts, _selective_policy)
        return functools.partial(checkpoint, forward, use_reentrant=False, context_fn=context)
    raise ValueError(f"activation checkpointing {ac!r} is not none, full or selective")


def compiled(forward: Callable) -> Callable:
    """`torch.compile(forward)`. Its input must not be a view of a DTensor's local tensor (the
    TP embedding's style hands the blocks a copy, `VocabEmbeddingParallel` in
    actors/parallel/parallelize.py): AOTAutograd replays a view input on its base and the gradient
    would bypass DTensor's `to_local` backward."""
    return torch.compile(forward)


def wrap_blocks(model: nn.Module, ac: str = "none", compile_blocks: bool = False, blocks_attr: str = "layers") -> None:
    """Checkpoint and/or compile each block of `model` (the ModuleDict `blocks_attr`) in place."""
    if ac == "none" and not compile_blocks:
        return
    if ac == "selective" and compile_blocks:
        # Dynamo warns (once per process, on every rank) that a selective policy under compile must
        # not meet in-place ops; the reference blocks have none (tests/unit/test_activation_checkpointing.py
        # checks the gradients are bit-equal to no AC).
        logging.getLogger("torch._higher_order_ops.wrap").setLevel(logging.ERROR)
    for block in getattr(model, blocks_attr, {}).values():
        forward = block.forward
        if compile_blocks and ac == "full":
            # Full AC around the compiled graph: inside it, a TP block's checkpoint region saves
            # its DeviceMesh for the backward and AOTAutograd refuses (torch 2.13). Outside, the
            # recompute runs the same compiled graph again.
            forward = checkpointed(compiled(forward), ac)
        else:
            # Selective AC's policy must see each op, so it goes inside the compiled graph
            # (torchtitan's order); dynamo traces it as a higher-order op.
            if ac != "none":
                forward = checkpointed(forward, ac)
            if compile_blocks:
                forward = compiled(forward)
        block.forward = forward
