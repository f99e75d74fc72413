"""A stage's backward in two halves: I (input gradient) now, W (weight gradients) later.

Zero-bubble schedules send the input gradient upstream as early as possible and fill bubbles
with the weight gradients. W must reuse what I computed, not run the backward again. The method
is torch.distributed.pipelining's (`_backward.stage_backward_input` / `stage_backward_weight`):

- I walks the autograd graph once, finds the "intermediates": nodes on the path from the stage
  input to its output that also lead to a weight. Hooks capture the gradient arriving at each
  intermediate while autograd computes only the input gradient (retain_graph keeps the saved
  tensors the weight half needs).
- W resumes autograd from those intermediates with the captured gradients, towards the weights
  only. Each node's input-gradient work is done once (in I) and its weight-gradient work once
  (in W).

Weights are found in the graph itself (its AccumulateGrad leaves), not from module.parameters():
under FSDP2 the tensors the forward used are the unsharded parameters, whatever the module lists.
The first stage's input is token ids, which have no gradient; there I has nothing to compute and
W runs the whole backward.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node


def _node_of(tensor: torch.Tensor) -> Node | None:
    """The autograd node that receives `tensor`'s gradient (AccumulateGrad for a leaf)."""
    if tensor.grad_fn is not None:
        return tensor.grad_fn
    if tensor.requires_grad:  # a leaf: its AccumulateGrad node exists once a view is taken
        return tensor.view_as(tensor).grad_fn.next_functions[0][0]
    return None


def _consumers(roots: list[Node]) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below `roots`: node -> the nodes whose gradient flows into it."""
    consumers: dict[Node, list[Node]] = collections.defaultdict(list)
    queue, seen = collections.deque(roots), set(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers[child].append(node)
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return consumers


def _closure(starts: list[Node], consumers: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from `starts` towards the outputs, not entering `stop`; and the `stop`
    nodes met on the way."""
    reached, met = set(starts), set()
    queue = collections.deque(starts)
    while queue:
        for consumer in consumers.get(queue.popleft(), ()):
            if consumer in reached:
                continue
            if consumer in stop:
                met.add(consumer)
                continue
            reached.add(consumer)
            queue.append(consumer)
    return reached, met


@dataclass
class _WeightGroup:
    weights: set[Node]  # AccumulateGrad nodes
    intermediates: list[Node]
    grads: list[tuple | None] = field(default_factory=list)  # captured per intermediate


@dataclass
class PendingWeightGrad:
    """What I leaves for W: either weight groups with captured gradients, or (first stage) the
    whole backward to run."""

    groups: list[_WeightGroup] | None
    outputs: list[torch.Tensor] | None = None
    output_grads: list[torch.Tensor] | None = None


def _weight_groups(output_nodes: list[Node], input_nodes: list[Node]) -> list[_WeightGroup]:
    consumers = _consumers(output_nodes)
    on_input_path, _ = _closure(input_nodes, consumers, set())
    inputs = set(input_nodes)
    weights = [node for node in consumers if hasattr(node, "variable") and node not in inputs]
    by_intermediate: dict[Node, _WeightGroup] = {}
    for weight in weights:
        _, intermediates = _closure([weight], consumers, on_input_path)
        if not intermediates:
            # Its gradient would not depend on the stage input; no stage of this model has one.
            raise RuntimeError(f"weight {tuple(weight.variable.shape)} does not meet the input's path to the "
                               "output; the input/weight backward split cannot serve it (use B, not I/W)")
        group = _WeightGroup({weight}, list(intermediates))
        for node in intermediates:  # weights that share an intermediate form one group
            existing = by_intermediate.get(node)
            if existing is not None and existing is not group:
                existing.weights |= group.weights
                existing.intermediates = list(dict.fromkeys(existing.intermediates + group.intermediates))
                for moved in group.intermediates:
                    by_intermediate[moved] = existing
                group = existing
            else:
                by_intermediate[node] = group
    unique = {id(group): group for group in by_intermediate.values()}
    return list(unique.values())


def backward_input(outputs: list[torch.Tensor], output_grads: list[torch.Tensor] | None,
                   inputs: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], PendingWeightGrad]:
    """Gradients of `inputs` only; returns them and what `backward_weight` needs later.

    output_grads None means the outputs are the loss (gradient one).
    """
    grads = output_grads if output_grads is not None else [torch.ones_like(out) for out in outputs]
    differentiable = [tensor for tensor in inputs if tensor.requires_grad]
    if not differentiable:
        return [None] * len(inputs), PendingWeightGrad(None, outputs, grads)
    output_nodes = [node for node in map(_node_of, outputs) if node is not None]
    input_nodes = [node for node in map(_node_of, differentiable) if node is not None]
    groups = _weight_groups(output_nodes, input_nodes)
    handles = []
    try:
        for group in groups:
            group.grads = [None] * len(group.intermediates)
            for index, node in enumerate(group.intermediates):
                def capture(grad_outputs, group=group, index=index):
                    group.grads[index] = grad_outputs
                handles.append(node.register_prehook(capture))
        computed = torch.autograd.grad(outputs, differentiable, grads, retain_graph=True, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip(map(id, differentiable), computed))
    return [by_input.get(id(tensor)) for tensor in inputs], PendingWeightGrad(groups)


def _accumulate(leaf: torch.Tensor, grad: torch.Tensor) -> None:
    if leaf.grad is None:
        leaf.grad = grad
    else:
        leaf.grad += grad


def backward_weight(pending: PendingWeightGrad) -> None:
    """Accumulate the weight gradients into `.grad`, resuming from what `backward_input` kept."""
    if pending.groups is None:
        torch.autograd.backward(pending.outputs, pending.output_grads)
        return
    for group in pending.groups:
        edges, seeds = [], []
        for node, captured in zip(group.intermediates, group.grads):
            for index, grad in enumerate(captured or ()):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    seeds.append(grad)
        if not edges:
            continue
        handles = []
        try:
            if len(group.intermediates) > 1:
                # One intermediate may lie downstream of another; autograd would add the
                # upstream one's contribution to the gradient we already captured for it.
                for node, captured in zip(group.intermediates, group.grads):
                    handles.append(node.register_prehook(lambda grad_outputs, captured=captured: captured))
            weights = list(group.weights)
            computed = torch.autograd.grad(edges, [GradientEdge(weight, 0) for weight in weights], seeds)
        finally:
            for handle in handles:
                handle.remove()
        for weight, grad in zip(weights, computed):
            _accumulate(weight.variable, grad)
    pending.groups = None
