"""SwiGLU over a fused gate_up output whose last dim interleaves (gate_j, up_j) per hidden unit.

float32: computed on the two stride-2 views, as plain autograd would, with the same kernels in the
same order, so forward and backward are bit-identical to `F.silu(v[..., 0]) * v[..., 1]`. The
difference is the backward's assembly of the fused gradient: autograd's two index backwards each
zero-fill a gradient the size of the whole fused output and copy their half in (two fills and two
strided copies, about 5% of a small-preset step on a CPU); here both halves are written straight
into their views of one empty gradient. Why not a contiguous de-interleaved copy, which is faster
still: its vectorised SiLU rounds differently from the strided one, and the 250-step continuity
run (a float32 claim) drifted between layouts on that trajectory (bench/RESULTS.md, throughput).

bfloat16 on a CPU: gate and up are first copied out contiguous. There the strided bf16 SiLU and
its backward take the scalar path, 5x the vectorised kernel (109 against 18 ms a small-preset
step), and bf16's own rounding swamps the float32 kernels' ulp differences; the results are those
of plain autograd on the contiguous halves, bit for bit (decision 78). A GPU's elementwise kernels
take strided views at full speed, so there the copies would only add memory traffic.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class _InterleavedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        pairs = gate_up.unflatten(-1, (-1, 2))
        gate, up = pairs[..., 0], pairs[..., 1]
        ctx.copied = gate_up.dtype != torch.float32 and gate_up.device.type == "cpu"
        if ctx.copied:
            gate, up = gate.contiguous(), up.contiguous()
        activated = F.silu(gate)
        ctx.save_for_backward(gate, up, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        gate, up, activated = ctx.saved_tensors
        if ctx.copied:  # contiguous kernels, then one interleaving copy
            return torch.stack((torch.ops.aten.silu_backward(grad * up, gate), grad * activated), dim=-1).flatten(-2)
        grad_gate_up = torch.empty((*gate.shape[:-1], 2 * gate.shape[-1]), dtype=gate.dtype, device=gate.device)
        grad_pairs = grad_gate_up.unflatten(-1, (-1, 2))
        # What autograd computes for silu(gate) * up, each written into its half of the result.
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_pairs[..., 0])
        torch.mul(grad, activated, out=grad_pairs[..., 1])
        return grad_gate_up


def interleaved_swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * hidden] laid out (gate_0, up_0, gate_1, up_1, ...)."""
    return _InterleavedSwiGLU.apply(gate_up)
