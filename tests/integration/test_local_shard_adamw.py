"""LocalShardAdamW steps the local shards of DTensor parameters: bit for bit what torch's AdamW
computes through DTensor's dispatch, on real gloo process groups, over uneven row shards, column
shards, replicated and plain parameters; and a gradient not laid out as its parameter (a Partial
one, still to be summed) takes DTensor's path, which reduces it first."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import rayshard.actors.parallel.local_shard_adamw as local_shard_adamw
from rayshard.actors.parallel.local_shard_adamw import LocalShardAdamW
from rayshard.actors.parallel.shards import local_tensor as local
from tests.forked_ranks import run_ranks

STEPS = 3
# (shape, placement): 7 rows over 2 ranks are 4 + 3, 5 columns 3 + 2.
PARAMETERS = [((7, 5), Shard(0)), ((6, 5), Shard(1)), ((3, 4), Replicate()), ((9,), Shard(0))]


def _values(shape, seed: int) -> torch.Tensor:
    """Asymmetric values: a transposed or swapped shard would not match."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) + torch.arange(torch.Size(shape).numel()).reshape(shape) / 7


def _parameters(mesh, partial_grad: bool):
    """The same parameters twice (one set per optimizer) and, per step, their gradients."""
    sets = []
    for _ in range(2):
        params = [torch.nn.Parameter(distribute_tensor(_values(shape, index), mesh, [placement]))
                  for index, (shape, placement) in enumerate(PARAMETERS)]
        params.append(torch.nn.Parameter(_values((2, 3), 99)))  # a plain tensor, stepped as it is
        sets.append(params)
    grads = []
    for step in range(STEPS):
        per_param = [distribute_tensor(_values(shape, 10 * step + index + 50), mesh, [placement])
                     for index, (shape, placement) in enumerate(PARAMETERS)]
        if partial_grad:  # each rank holds a part of the replicated parameter's gradient: a sum to take
            whole = _values(PARAMETERS[2][0], 10 * step + 77) * (dist.get_rank() + 1)
            per_param[2] = DTensor.from_local(whole, mesh, [Partial()], run_check=False)
        per_param.append(_values((2, 3), 10 * step + 98))
        grads.append(per_param)
    return sets, grads


def _compare(rank: int, init_method: str, world_size: int, results, partial_grad: bool) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        mesh = init_device_mesh("cpu", (world_size,))
        (reference_params, local_params), grads = _parameters(mesh, partial_grad)
        settings = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
        # A plain tensor in its own group, as the trainer groups by mesh: DTensor's path refuses a mix.
        reference, stepped = (kind([{"params": params[:-1]}, {"params": params[-1:]}], **settings)
                              for kind, params in ((torch.optim.AdamW, reference_params), (LocalShardAdamW, local_params)))
        calls = []  # per group and step: whether the kernel got DTensors (DTensor's path) or local tensors
        kernel = local_shard_adamw.adam

        def spy(params, *args, **kwargs):
            calls.append(any(isinstance(p, DTensor) for p in params))
            return kernel(params, *args, **kwargs)

        local_shard_adamw.adam = spy
        try:
            for step in range(STEPS):
                for params in (reference_params, local_params):
                    for param, grad in zip(params, grads[step]):
                        param.grad = grad.clone() if not isinstance(grad, DTensor) else \
                            DTensor.from_local(grad.to_local().clone(), mesh, grad.placements, run_check=False,
                                               shape=grad.shape, stride=grad.stride())
                reference.step()
                stepped.step()
        finally:
            local_shard_adamw.adam = kernel

        equal = []
        for mine, theirs in zip(local_params, reference_params):
            equal.append(torch.equal(local(mine.detach()), local(theirs.detach())))
            for kind in ("exp_avg", "exp_avg_sq"):
                equal.append(torch.equal(local(stepped.state[mine][kind]), local(reference.state[theirs][kind])))
                equal.append(type(stepped.state[mine][kind]) is type(reference.state[theirs][kind]))
        results[rank] = {"equal": equal, "dtensor_kernel_calls": calls,
                         "moved": not torch.equal(local(local_params[0].detach()),
                                                  local(distribute_tensor(_values((7, 5), 0), mesh, [Shard(0)])))}
    finally:
        dist.destroy_process_group()


def test_local_shard_steps_are_bit_exact_to_dtensor_dispatch():
    results = run_ranks(_compare, 2, False)
    for rank, answer in results.items():
        assert all(answer["equal"]), (rank, answer["equal"])
        assert answer["moved"], "the parameters did not change: the comparison would prove nothing"
        assert answer["dtensor_kernel_calls"] == [False, False] * STEPS, answer  # the local path was taken


def test_a_partial_gradient_takes_dtensors_path_and_is_reduced_first():
    results = run_ranks(_compare, 2, True)
    for rank, answer in results.items():
        assert all(answer["equal"]), (rank, answer["equal"])
        assert answer["dtensor_kernel_calls"] == [True, False] * STEPS, answer  # the plain group steps as it is
