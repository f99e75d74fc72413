"""Apply tensor and data parallelism to a single-device model, from outside.

TP is DTensor's `parallelize_module` driven by a plan keyed by module-name patterns (the
user-facing form: a model written as plain code plus a mapping of names to styles). Sharded
and replicated data parallelism are FSDP2's `fully_shard` on a (dp, fsdp) mesh — HSDP, which
also covers plain DP (fsdp=1) and plain FSDP (dp=1). We write none of these collectives.
"""
from __future__ import annotations

import fnmatch
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from rayshard.actors.parallel.block_wrappers import wrap_blocks
from rayshard.actors.parallel.expert_dispatch import AllToAllDispatch, TensorParallelDispatch
from rayshard.actors.model.moe import is_expert_parameter, moe_layers
from rayshard.actors.parallel.parameter_casts import cast_parameters
from rayshard.actors.parallel.precision import compute_dtype, fsdp_policy, uses_fsdp
from rayshard.plans.layout.parallel_layout import DATA_MESH_DIMS
from rayshard.plans.training.model_plan import ModelPlan
from rayshard.plans.training.model_spec import REFERENCE_PLAN
from rayshard.actors.model.lora import rehook
from rayshard.plans.training.tp_plan import (ADAPTER_SPLIT, LORA_ROWWISE_TO_SEQUENCE, COLWISE, EXPERT_COLWISE, EXPERT_ROWWISE, GATHER_SEQUENCE,
                                    POSITIONS_TO_SEQUENCE, ROWWISE, ROWWISE_TO_SEQUENCE, SEQUENCE_PARALLEL,
                                    SEQUENCE_PARALLEL_TO_LOCAL,
                                    VOCAB_EMBEDDING, VOCAB_EMBEDDING_TO_SEQUENCE, VOCAB_HEAD,
                                    VOCAB_HEAD_FROM_SEQUENCE, with_sequence_parallel)

class GatherSequence(ParallelStyle):
    """The module's first input arrives split over the sequence (Shard(1)) and is all-gathered
    into the whole sequence (a Replicate DTensor) before the module runs; other inputs (RoPE
    tables) pass untouched. torch's `PrepareModuleInput` needs one layout per input, so one style
    could not serve attention (x, cos, sin) and the feed-forward (x)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def gather(module, args):
            x = args[0]
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, (Shard(1),), run_check=False)
            return (x.redistribute(device_mesh, (Replicate(),)), *args[1:])

        module.register_forward_pre_hook(gather)
        return module


class VocabEmbeddingParallel(RowwiseParallel):
    """The vocab-parallel embedding (torch's RowwiseParallel on an nn.Embedding) whose output the
    model receives as a tensor of its own, not as `to_local()`'s view of the DTensor's local
    tensor. That output is the first block's input, and gradients through such a view go astray
    in torch 2.13: a compiled block's AOTAutograd replays a view input on its base, so DTensor's
    redistribute backward receives a plain tensor (a user model with --sp --compile failed), and
    local_map's to_local gave the embedding a wrong gradient. Done in the style, it holds for
    every model, built-in or the user's; it costs one copy of the embedding output per microbatch."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        output = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return output.clone() if use_local_output else output


class SequenceParallelToResidual(SequenceParallel):
    """A norm on the sequence shard whose input is a row-parallel output and whose output is added
    to the residual stream, which between the blocks' halves is the rank's plain shard: Gemma's
    norms after attention and after the feed-forward. The input arrives as `to_local()`'s view of
    the reduce-scattered DTensor, and wrapping that view again with `from_local` lost the gradient
    through it in torch 2.13 (every weight before the norm got none; see VocabEmbeddingParallel
    for the same family of trouble), so the view is copied first: one copy per norm."""

    def __init__(self):
        super().__init__(use_local_output=True)

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        x = inputs[0]
        if not isinstance(x, DTensor):  # the row-parallel output's `to_local()` view
            x = x.clone()
        return SequenceParallel._prepare_input_fn(sequence_sharding, mod, (x, *inputs[1:]), device_mesh)


class PositionsToSequence(ParallelStyle):
    """Learned positions under sequence parallelism (GPT-2): the table is a Replicate DTensor on
    the tp mesh (as sequence-parallel norm weights are), the whole sequence's rows are looked up,
    and each rank keeps its sequence shard's (Shard(0) of [seq, dim]) as a plain tensor to add to
    its shard of the token embedding. The backward of that redistribution gathers the shards'
    gradients, so every tp rank computes the table's whole gradient: it stays one replicated
    parameter with no partial sum to add."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh, [Replicate()]),
                                     requires_grad=module.weight.requires_grad)  # frozen stays frozen (LoRA)

        def positions_in(module, args):
            return (DTensor.from_local(args[0], device_mesh, (Replicate(),), run_check=False),)

        def shard_out(module, args, output):
            return output.redistribute(device_mesh, (Shard(0),)).to_local()

        module.register_forward_pre_hook(positions_in)
        module.register_forward_hook(shard_out)
        return module


class StackedShard(ParallelStyle):
    """Stacked expert weights [experts, out, in] split along `dim` over tp (each expert's hidden
    units); the MoE layer computes on the local piece (`actors/model/moe.py`), and its dispatch
    adds the partial results over tp (`actors/parallel/expert_dispatch.py`)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.weight = nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(self.dim)]),
                                     requires_grad=module.weight.requires_grad)  # frozen stays frozen (LoRA)
        return module


class AdapterShard(ParallelStyle):
    """A LoRA adapter (`actors/model/lora.py`): its `parameter` split along `dim` over tp, the other
    copied; the adapter computes on its local pieces and learns the tp group from here.
    to_sequence: beside a base whose output is the rank's sequence shard (--sp), so is the delta."""

    def __init__(self, parameter: str, dim: int, to_sequence: bool = False):
        super().__init__()
        self.parameter, self.dim, self.to_sequence = parameter, dim, to_sequence

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        param = getattr(module, self.parameter)
        module.register_parameter(self.parameter, nn.Parameter(distribute_tensor(param, device_mesh, [Shard(self.dim)]),
                                                               requires_grad=param.requires_grad))
        module.tp_group = device_mesh.get_group()
        module.to_sequence = self.to_sequence
        rehook(module)  # a user model's adapter: its hook after the base's tp style's (actors/model/lora.py)
        return module


# torch's ParallelStyle for each style of the plan (`plans/training/tp_plan.py`, which says why
# each module gets its style).
TORCH_STYLES: dict[str, ParallelStyle] = {
    COLWISE: ColwiseParallel(),
    ROWWISE: RowwiseParallel(),
    VOCAB_EMBEDDING: VocabEmbeddingParallel(input_layouts=Replicate(), output_layouts=Replicate()),
    VOCAB_HEAD: ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    # Sequence parallelism: the residual stream is Shard(1) (the sequence) between the matmuls.
    ROWWISE_TO_SEQUENCE: RowwiseParallel(output_layouts=Shard(1)),
    VOCAB_EMBEDDING_TO_SEQUENCE: VocabEmbeddingParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    VOCAB_HEAD_FROM_SEQUENCE: ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    SEQUENCE_PARALLEL: SequenceParallel(),
    SEQUENCE_PARALLEL_TO_LOCAL: SequenceParallelToResidual(),
    GATHER_SEQUENCE: GatherSequence(),
    POSITIONS_TO_SEQUENCE: PositionsToSequence(),
    EXPERT_COLWISE: StackedShard(1),
    EXPERT_ROWWISE: StackedShard(2),
    **{style: AdapterShard(parameter, dim, style == LORA_ROWWISE_TO_SEQUENCE)
       for style, (parameter, dim) in ADAPTER_SPLIT.items()},
}
EXPERT_STYLES = (EXPERT_COLWISE, EXPERT_ROWWISE)


def resolve_tp_plan(model: nn.Module, patterns: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """Expand module-name patterns (fnmatch) to the concrete module names present in `model`."""
    resolved: dict[str, ParallelStyle] = {}
    names = [name for name, _ in model.named_modules() if name]
    for pattern, style in patterns.items():
        for name in fnmatch.filter(names, pattern):
            resolved[name] = style
    return resolved


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, patterns: dict[str, ParallelStyle]) -> None:
    # torch's styles re-create the parameters they place (SequenceParallel's norm weights, for
    # one) with requires_grad=True: a frozen weight (LoRA's base) must stay frozen.
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, resolve_tp_plan(model, patterns))
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def torch_plan(styles: tuple[tuple[str, str], ...], sequence_parallel: bool,
               additions: tuple[tuple[str, str], ...], expert_parallel: bool = False) -> dict[str, ParallelStyle]:
    """A model plan's tp styles (`plans/training/model_plan.py`) as torch's ParallelStyles.
    expert_parallel: the experts' tp split is left to `apply_expert_parallel`, which places them
    on the data and tp dims at once."""
    named = with_sequence_parallel(dict(styles), dict(additions)) if sequence_parallel else dict(styles)
    return {pattern: TORCH_STYLES[style] for pattern, style in named.items()
            if not (expert_parallel and style in EXPERT_STYLES)}


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, tp: int, ep: int) -> list[nn.Parameter]:
    """Experts of every MoE layer split over the fsdp ranks (ep = fsdp): each stacked weight
    becomes a DTensor on the (dp, fsdp, tp) mesh, Shard(0) over fsdp (consecutive experts per
    rank), copied over dp, and split over tp as its style says. Its region is then exactly the
    one FSDP2 would give it (dim 0 cut into fsdp blocks), so checkpoints do not see ep. Installs
    the all-to-all dispatch; returns the expert parameters (FSDP leaves them alone, the trainer
    reduces their gradients over dp: `reduce_expert_gradients`). With ep = 1 only the dispatch
    changes (tp adds partial results); FSDP2 and TP hold the experts like any weight."""
    layers = moe_layers(model)
    tp_group = mesh["tp"].get_group() if tp > 1 else None
    if ep == 1:
        for _, layer in layers:
            if tp_group is not None:
                layer.dispatch = TensorParallelDispatch(tp_group)
        return []
    stage_mesh = mesh[("dp", "fsdp", "tp")]
    ep_group = mesh["fsdp"].get_group()
    experts = []
    for _, layer in layers:
        for linear, split in ((layer.experts.gate_up, 1), (layer.experts.down, 2)):
            placements = [Replicate(), Shard(0), Shard(split) if tp > 1 else Replicate()]
            # A frozen expert (LoRA's base) stays frozen: no gradient to compute or reduce over dp.
            linear.weight = nn.Parameter(distribute_tensor(linear.weight, stage_mesh, placements),
                                         requires_grad=linear.weight.requires_grad)
            experts.append(linear.weight)
        layer.dispatch = AllToAllDispatch(ep_group, tp_group)
    return experts


def expert_parameters(model) -> list[nn.Parameter]:
    """The stacked expert weights of a model's MoE layers (`moe.EXPERT_PARAMETERS`)."""
    return [param for name, param in model.named_parameters() if is_expert_parameter(name)]


@torch.no_grad()
def reduce_expert_gradients(parameters: list[nn.Parameter], mesh: DeviceMesh, dp: int, data_parallel_size: int,
                            timeout: timedelta | None = None) -> None:
    """Under ep, the experts' gradients as FSDP would leave them: each rank's expert gradient
    already sums its fsdp peers' tokens (the all-to-all's backward brought them); add the dp
    replicas' (one all-reduce) and divide by the data-parallel size, as FSDP2 averages."""
    pieces = _local_gradients(parameters)
    if not pieces:
        return
    if dp > 1:
        _sum_in_one_all_reduce(pieces, mesh["dp"].get_group(), timeout)
    torch._foreach_div_(pieces, float(data_parallel_size))


def _local_gradients(parameters: list[nn.Parameter]) -> list[torch.Tensor]:
    return [param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            for param in parameters if param.grad is not None]


def _sum_in_one_all_reduce(pieces: list[torch.Tensor], group, timeout: timedelta | None) -> None:
    """Sum every piece over `group` in place with one collective, not one per tensor."""
    flat = torch.cat([piece.reshape(-1) for piece in pieces])
    work = dist.all_reduce(flat, group=group, async_op=True)
    work.wait(timeout) if timeout is not None else work.wait()
    offset = 0
    for piece in pieces:
        piece.copy_(flat[offset:offset + piece.numel()].view_as(piece))
        offset += piece.numel()


def apply_data_parallel(model: nn.Module, dp_mesh: DeviceMesh, reshard_after_forward: bool = True,
                        precision: str = "fp32", blocks_attr: str = "layers",
                        ignored: list[nn.Parameter] | None = None) -> None:
    """FSDP2 per transformer block (so only one block is gathered at a time), then the root.
    ignored: parameters placed already (experts under ep) that FSDP must neither shard nor reduce."""
    policy = fsdp_policy(precision)
    ignored_params = set(ignored) if ignored else None
    blocks = getattr(model, blocks_attr, {})
    for block in blocks.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                    ignored_params=ignored_params)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy,
                ignored_params=ignored_params)


def parallelize(model: nn.Module, mesh: DeviceMesh, tp: int, data_parallel_size: int,
                tie_embeddings: bool = False, pipeline: bool = False, precision: str = "fp32",
                ac: str = "none", compile_blocks: bool = False, sequence_parallel: bool = False,
                plan: ModelPlan = REFERENCE_PLAN, ep: int = 1) -> nn.Module:
    """TP, then activation checkpointing and compile per block, then FSDP2 (torchtitan's order).

    pipeline: `model` is one stage of a pipeline. FSDP then keeps parameters gathered from
    the first forward to the end of the step (as torchtitan does under PP): the schedule
    interleaves microbatches' forwards and backwards, and regathering per microbatch would
    multiply the all-gathers by the microbatch count.
    sequence_parallel: the TP plan's sequence-parallel form (`tp_plan.with_sequence_parallel`).
    precision "bf16": FSDP2 with bf16 parameters and float32 reduction; over a one-rank data mesh
    outside a pipeline, FSDP2's casts alone (`actors/parallel/precision.py` says why).
    plan: the model's plan, data (`ModelConfig.plan`): its tp styles (sequence-parallel form
    derived, not repeated) and its blocks, the unit of AC, compile and FSDP2.
    ep: expert parallelism for MoE layers (`apply_expert_parallel`)."""
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"], torch_plan(plan.tp_styles, sequence_parallel, plan.sequence_parallel,
                                                            expert_parallel=ep > 1))
        if sequence_parallel:
            model.sequence_shards = tp
        if tie_embeddings and model.tok_embeddings is not None and model.output is not None:
            # parallelize_module gives each module its own DTensor parameter; both are
            # Shard(0) over the vocabulary on the same mesh, so one can serve both again.
            model.output.weight = model.tok_embeddings.weight
    placed_experts = apply_expert_parallel(model, mesh, tp, ep)
    wrap_blocks(model, ac, compile_blocks, plan.blocks)
    if uses_fsdp(precision, data_parallel_size, pipeline):
        # Over a one-rank data mesh resharding frees nothing a regather would not rebuild: it only
        # repeats each block's bf16 cast and copies in the backward (decision 78).
        reshard = not pipeline and data_parallel_size > 1
        apply_data_parallel(model, mesh[DATA_MESH_DIMS], reshard_after_forward=reshard, precision=precision,
                            blocks_attr=plan.blocks, ignored=placed_experts)
    elif precision != "fp32":
        cast_parameters(model, compute_dtype(precision), plan.blocks, ignored=placed_experts)
    return model


def defer_gradient_reduction(stage: nn.Module) -> None:
    """Before a pipeline step: accumulate unsharded gradients over every microbatch and keep
    parameters gathered; `reduce_gradients_now` reduces once at the end of the step."""
    if isinstance(stage, FSDPModule):
        stage.set_is_last_backward(False)
        stage.set_reshard_after_backward(False)
        stage.set_requires_gradient_sync(False)


def reduce_gradients_now(stage: nn.Module) -> None:
    """After a pipeline step: one reduce-scatter (and dp all-reduce) of the accumulated
    gradients, then reshard.

    The split backward (I/W) calls autograd.grad, which never fires FSDP2's end-of-backward
    callback with the last microbatch, so we run FSDP2's post-backward ourselves. This is
    torch.distributed.pipelining's `_PipelineStageBase.perform_reduce_grad` (private FSDP2
    state, pinned torch version)."""
    if not isinstance(stage, FSDPModule):
        return
    stage.set_is_last_backward(True)
    stage.set_reshard_after_backward(True)
    stage.set_requires_gradient_sync(True)
    state = fully_shard.state(stage)
    for module_state in state._state_ctx.all_states:
        for param_group in module_state._fsdp_param_groups:
            param_group.post_backward()
    state._root_post_backward_final_callback()


def tp_partial_parameters(model: nn.Module, patterns: tuple[str, ...]) -> list[nn.Parameter]:
    """The parameters the plan names as tp-partial (`ModelPlan.tp_partial_gradients`): weights
    every tp rank holds whole but applies only to its own heads, so each rank's gradient is its
    heads' share. Resolved once per run; the set does not change between steps."""
    return [param for name, param in model.named_parameters()
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)]


@torch.no_grad()
def sum_partial_gradients(parameters: list[nn.Parameter], tp_mesh: DeviceMesh, timeout: timedelta | None = None) -> int:
    """Add up the gradients of `parameters` (`tp_partial_parameters`) over the tp ranks: after
    the sum every tp rank holds the whole gradient and takes the same optimizer step, so the
    copies stay equal. Under FSDP the gradient is already the rank's data shard (reduced over dp
    and fsdp); the sum over tp is linear, so the order does not matter. Returns how many
    gradients it summed."""
    pieces = _local_gradients(parameters)
    if not pieces:
        return 0
    _sum_in_one_all_reduce(pieces, tp_mesh.get_group(), timeout)
    return len(pieces)
