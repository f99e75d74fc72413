"""Which experts a damaged stacked expert tensor lacks or has too many of.

Experts are stored stacked, dim 0 the global expert index (`plans/training/model_spec.moe_shapes`),
so a checkpoint that dropped an expert, or renumbered one past the end, shows as chunks that do
not tile dim 0. The tiling check and the reshard planner say that in elements; for an expert
tensor this says it in experts, which is what a person has to go and find."""
from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence

from rayshard.plans.training.model_spec import EXPERT_TENSORS


def expert_note(name: str, global_shape: Sequence[int], chunks: Sequence,
                region: tuple[Sequence[int], Sequence[int]] | None = None) -> str:
    """' (experts ...)' naming the experts whose rows the chunks do not hold exactly once, or ''
    for a tensor that is not a stacked expert tensor (or whose experts all look whole).
    region: (offsets, sizes) of the part a reader needs; only it is counted."""
    if not fnmatch.fnmatchcase(name, EXPERT_TENSORS) or len(global_shape) < 2:
        return ""
    experts = global_shape[0]
    offsets, sizes = region if region is not None else ((0,) * len(global_shape), tuple(global_shape))
    per_expert = math.prod(sizes[1:])
    held: dict[int, int] = {}
    for chunk in chunks:
        inner = math.prod(_overlap(chunk.offsets[d], chunk.sizes[d], offsets[d], sizes[d]) for d in range(1, len(sizes)))
        for expert in range(chunk.offsets[0], chunk.offsets[0] + chunk.sizes[0]):
            if region is None or offsets[0] <= expert < offsets[0] + sizes[0]:
                held[expert] = held.get(expert, 0) + inner
    missing = [e for e in range(offsets[0], offsets[0] + sizes[0]) if held.get(e, 0) < per_expert]
    doubled = [e for e in range(experts) if held.get(e, 0) > per_expert]
    beyond = sorted(e for e in held if not 0 <= e < experts)
    parts = []
    if missing:
        parts.append(f"missing or incomplete: expert {_spans(missing)}")
    if doubled:
        parts.append(f"stored twice: expert {_spans(doubled)}")
    if beyond:
        parts.append(f"beyond the model's {experts} experts: expert {_spans(beyond)}")
    return f" (experts {'; '.join(parts)})" if parts else ""


def _overlap(start: int, size: int, other_start: int, other_size: int) -> int:
    return max(0, min(start + size, other_start + other_size) - max(start, other_start))


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans, start = [], indices[0]
    for previous, current in zip(indices, indices[1:] + [None]):
        if current != previous + 1:
            spans.append(f"{start}" if start == previous else f"{start}-{previous}")
            start = current
    return ", ".join(spans)
