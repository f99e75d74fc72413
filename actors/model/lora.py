"""LoRA on the built-in decoder: adapters beside the frozen base projections, applied from outside.

`apply_lora` (the converter, run on the meta-device model after it is built and before it is
parallelized) freezes every base parameter, adds a `lora` ModuleDict of `LoraAdapter`s to each
attention and feed-forward, and switches those modules to the subclasses below, whose forward adds
(alpha / r) * B (A x) to each targeted logical projection's own output (plans/training/lora.py).
Base parameters keep their names, so the base checkpoint loads into them as it is; the base
weights are read, never written.

Fused projections: q, k and v get their deltas after the fused qkv output is split into heads,
gate and up before the SwiGLU activation, so each acts exactly as a separate projection's adapter.

Tensor parallelism (Megatron-LM's f and g): the adapters compute on local pieces. Beside a
column-parallel base, A is whole on every tp rank and B holds the rank's output rows; t = A x is
the same on every tp rank, and the rank's gradient of t covers only its rows, so the backward sums
it over tp (`_SumGradientOverTp`) before it reaches A and x. Beside a row-parallel base, A holds
the rank's input columns: t is a partial sum, added over tp in the forward (`_SumOverTp`), and B
(whole) then gives every rank the whole delta, which is added after the base's own all-reduce.
No rank ever gathers an adapter or a base weight.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from rayshard.actors.model.feed_forward import FeedForward
from rayshard.actors.model.swiglu import ACTIVATIONS
from rayshard.actors.model.moe import MoEFeedForward
from rayshard.actors.model.transformer import Attention
from rayshard.plans.config.lora import LoraConfig
from rayshard.plans.training.lora import ATTENTION_TARGETS, FEED_FORWARD_TARGETS, projection_dims, user_adapted_modules
from rayshard.plans.training.tp_plan import ROWWISE, module_style


def freeze(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Every parameter of `model` frozen, and stored in `dtype` if given (a parameter two modules
    share stays one)."""
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if dtype is None or param.dtype == dtype:
                param.requires_grad_(False)
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(param.to(dtype), requires_grad=False)
            module._parameters[name] = replaced[id(param)]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class _SumGradientOverTp(torch.autograd.Function):
    """Identity forward; the backward adds the gradient over the tp group (Megatron's f)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _SumOverTp(torch.autograd.Function):
    """The forward adds over the tp group; identity backward (Megatron's g)."""

    @staticmethod
    def forward(ctx, tensor, group):
        tensor = tensor.contiguous().clone()
        dist.all_reduce(tensor, group=group)
        return tensor

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _SplitSequence(torch.autograd.Function):
    """The rank's sequence shard (dim 1) of a tensor every tp rank holds whole; the backward
    gathers the shards' gradients, so the whole tensor's gradient is again the same on every rank
    (Megatron's scatter to the sequence-parallel region)."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        return tensor.chunk(size, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        pieces = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(pieces, grad, group=ctx.group)
        return torch.cat(pieces, dim=1), None


class LoraAdapter(nn.Module):
    """A [rank, in] and B [out, rank] of one logical projection. `tp_group` is set when tensor
    parallelism splits one of them (`actors/parallel/parallelize.py`'s adapter styles);
    `row_parallel`: the base splits its input (o, down), else its output."""

    def __init__(self, features_in: int, features_out: int, rank: int, scale: float, dropout: float,
                 row_parallel: bool):
        super().__init__()
        self.a = nn.Parameter(torch.empty(rank, features_in))
        self.b = nn.Parameter(torch.empty(features_out, rank))
        self.scale, self.dropout, self.row_parallel = scale, dropout, row_parallel
        self.tp_group = None
        # --sp beside a row-parallel base whose output is the rank's sequence shard: the whole
        # delta is computed (it is small: rank r) and cut to that shard (`_SplitSequence`).
        self.to_sequence = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The delta of this projection's local output: x is the base's local input (whole beside a
        column-parallel base, the rank's columns beside a row-parallel one). The scale multiplies
        B ([out, r]) rather than the delta ([tokens, out]): the same product, without a full-size
        multiplication in the forward and another in the backward."""
        t = self._down(x)
        delta = t @ (_local(self.b) * self.scale).t().to(t.dtype)
        return _SplitSequence.apply(delta, self.tp_group) if self.to_sequence else delta

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out + forward(x), as one addmm (out + scale * t B^T) where `out` is a plain contiguous
        tensor: no delta tensor written and read again by an addition. Else the addition."""
        if isinstance(out, DTensor) or self.to_sequence or not out.is_contiguous():
            return out + self(x)
        t = self._down(x)
        b = _local(self.b).to(t.dtype)
        return torch.addmm(out.view(-1, out.shape[-1]), t.reshape(-1, t.shape[-1]), b.t(), alpha=self.scale).view(out.shape)

    def _down(self, x: torch.Tensor) -> torch.Tensor:
        """t = A x (after dropout), summed over tp beside a row-parallel base (Megatron's g) or its
        gradient summed beside a column-parallel one (f)."""
        x = _local(x)  # under --sp the block's input is the gathered sequence as a Replicate DTensor
        if self.dropout and self.training:
            x = self._dropout(x)
        t = x @ _local(self.a).t().to(x.dtype)
        if self.tp_group is not None:
            t = (_SumOverTp if self.row_parallel else _SumGradientOverTp).apply(t, self.tp_group)
        return t

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        """x with the adapter's dropout, drawn as one rank would draw it (decision 168): every tp
        rank of a group draws from the same generator state (seeded without the tp coordinate,
        `Trainer._seed_lora_dropout`), so beside a column-parallel base the whole x gets the same
        mask on each; beside a row-parallel one each rank draws the whole input's mask and keeps
        its own columns. Written out as CPU's F.dropout computes it (bernoulli_ on a tensor of
        x's shape, divided by 1 - p, multiplied) so one rank draws what F.dropout drew before."""
        keep = 1.0 - self.dropout
        if self.row_parallel and self.tp_group is not None:
            size, rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
            whole = x.new_empty(*x.shape[:-1], self.a.shape[1]).bernoulli_(keep)
            noise = whole.chunk(size, dim=-1)[rank]
        else:
            noise = torch.empty_like(x).bernoulli_(keep)
        return x * noise.div_(keep)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model alone: every adapter's delta is 0 (scale 0, no dropout) inside, as it was
    after. --objective dpo's reference with LoRA: the same weights, no second copy (decision 159)."""
    adapters = [module for module in model.modules() if isinstance(module, LoraAdapter)]
    saved = [(adapter.scale, adapter.dropout) for adapter in adapters]
    for adapter in adapters:
        adapter.scale, adapter.dropout = 0.0, 0.0
    try:
        yield
    finally:
        for adapter, (scale, dropout) in zip(adapters, saved):
            adapter.scale, adapter.dropout = scale, dropout


class LoraAttention(Attention):
    """Attention whose q, k, v (and o) projections carry adapters (`self.lora`)."""

    def project_qkv(self, x: torch.Tensor):
        q, k, v = super().project_qkv(x)
        deltas = []
        for name, projected in (("q", q), ("k", k), ("v", v)):
            if name in self.lora:
                projected = projected + self.lora[name](x).view_as(projected)
            deltas.append(projected)
        return tuple(deltas)

    def project_out(self, heads: torch.Tensor) -> torch.Tensor:
        out = self.wo(heads)
        return self.lora["o"].add_to(out, heads) if "o" in self.lora else out


class LoraFeedForward(FeedForward):
    """The SwiGLU feed-forward with adapters on gate, up and down. With gate or up adapted, the
    fused gate_up is applied here on its local rows, so the deltas land before the activation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if "gate" in self.lora or "up" in self.lora:
            hidden = self._adapted_swiglu(x)
        else:
            hidden = self.gate_up(x)
        out = self.down(hidden)
        return self.lora["down"].add_to(out, hidden) if "down" in self.lora else out

    def _adapted_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        x = _local(x)  # under --sp: the gathered sequence, a Replicate DTensor
        weight = _local(self.gate_up.weight)  # frozen: the rank's rows (gate_j, up_j) of its hidden units
        group = self.lora[next(iter(self.lora))].tp_group
        base_x = _SumGradientOverTp.apply(x, group) if group is not None else x  # its gradient is this rank's share
        weight = weight.to(x.dtype)
        gate, up = base_x @ weight[0::2].t(), base_x @ weight[1::2].t()
        if "gate" in self.lora:
            gate = self.lora["gate"].add_to(gate, x)
        if "up" in self.lora:
            up = self.lora["up"].add_to(up, x)
        return ACTIVATIONS[self.gate_up.activation][0](gate) * up


@torch.no_grad()
def apply_lora(model: nn.Module, spec, lora: LoraConfig, frozen_dtype: torch.dtype | None = None) -> None:
    """Freeze the base and add the adapters (on the meta device, before parallelize): the converter.
    frozen_dtype: the base's dtype where it differs from float32 (bf16 in a bf16 run: compute reads
    it in bf16 anyway, and nothing steps it, so no float32 master is kept)."""
    freeze(model, frozen_dtype)
    targets, scale = lora.target_list, lora.scale
    layers = model.layers.items() if model.layers is not None else ()
    for key, layer in layers:
        index = int(key)
        dims = projection_dims(spec, index)
        feed_forward = layer.feed_forward
        if isinstance(feed_forward, MoEFeedForward):  # routed experts take none; its shared expert does
            feed_forward = feed_forward.shared
        for module, names, kind in ((layer.attention, ATTENTION_TARGETS, LoraAttention),
                                    (feed_forward, FEED_FORWARD_TARGETS, LoraFeedForward)):
            chosen = [name for name in names if name in targets]
            if not chosen or module is None:
                continue
            device = next(module.parameters()).device
            with torch.device(device):
                module.lora = nn.ModuleDict({name: LoraAdapter(*dims[name], lora.rank, scale, lora.dropout,
                                                               name in ("o", "down")) for name in chosen})
            module.__class__ = kind


def _add_adapter_output(adapter: LoraAdapter, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """A forward hook on a user's Linear: its output plus its adapter's delta of the same input."""
    return adapter.add_to(output, args[0])


def hook_beside(adapter: LoraAdapter, base: nn.Module) -> None:
    """Add `adapter`'s delta to `base`'s output by a forward hook. Kept in the adapter's __dict__
    (not as a submodule: the base is the user's, with its own name) so that tensor parallelism can
    hook it again after torch's tp styles have added theirs (`rehook`)."""
    adapter.__dict__["_hooked"] = (base, base.register_forward_hook(functools.partial(_add_adapter_output, adapter)))


def rehook(adapter: nn.Module) -> None:
    """Run the adapter's hook after those torch's tp style put on its base since `hook_beside`, so
    it sees the base's local output (`use_local_output`) and adds the local delta to it."""
    hooked = adapter.__dict__.get("_hooked")
    if hooked is not None:
        base, handle = hooked
        handle.remove()
        hook_beside(adapter, base)


@torch.no_grad()
def apply_user_lora(model: nn.Module, spec, lora: LoraConfig, frozen_dtype: torch.dtype | None = None) -> None:
    """The converter for a user's model (`--model-factory`): the base frozen as `apply_lora`
    does, and each Linear the targets name (module-name patterns, `plans/training/lora.py`) gets
    an adapter beside it (`blocks.0.attn.q` -> `blocks.0.attn.lora.q`) whose delta a forward
    hook adds to the Linear's output. The user's code is untouched; on a pipeline stage, only the
    modules it holds are adapted."""
    freeze(model, frozen_dtype)
    modules = dict(model.named_modules())
    styles = dict(spec.plan.tp_styles)
    for name, (features_in, features_out) in user_adapted_modules(spec, lora).items():
        base = modules.get(name)
        if base is None:  # another pipeline stage's
            continue
        parent_name, _, child = name.rpartition(".")
        parent = modules[parent_name] if parent_name else model
        device = base.weight.device
        if "lora" not in parent._modules:
            with torch.device(device):
                parent.lora = nn.ModuleDict()
        with torch.device(device):
            adapter = LoraAdapter(features_in, features_out, lora.rank, lora.scale, lora.dropout,
                                  module_style(name, styles) == ROWWISE)
        parent.lora[child] = adapter
        hook_beside(adapter, base)
