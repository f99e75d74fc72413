"""Stage partition: which layers form each pipeline stage, and which rank runs each stage.

A model of N transformer layers is cut into S = pp * vpp contiguous stages. Stage 0 also runs
the embedding and stage S - 1 the LM head, so their costs count there. By default the cut
minimises the most expensive stage (the pipeline runs at the pace of its slowest stage) and,
among such cuts, keeps every stage close to the average; an explicit layout is accepted instead
and validated.

Stages go to ranks by a placement:
- single: one stage per rank, stage s on rank s (GPipe, 1F1B, ZB-H1);
- looped: stage s on rank s % pp, so each rank holds vpp stages pp apart (interleaved 1F1B);
- v:      rank r owns stages r and 2*pp - 1 - r (ZB-V, DualPipeV), so the first and last
          stage share rank 0 and the turn of the V happens inside rank pp - 1.
"""
from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from rayshard.plans.errors import ConfigError


class Placement(str, enum.Enum):
    SINGLE = "single"
    LOOPED = "looped"
    V = "v"

    def __str__(self) -> str:
        return self.value


def stage_ranks(pp: int, vpp: int, placement: Placement) -> tuple[int, ...]:
    """The rank of every stage (index = stage) under `placement`."""
    _check_degrees(pp, vpp, placement)
    stages = pp * vpp
    if placement is Placement.SINGLE:
        return tuple(range(pp))
    if placement is Placement.LOOPED:
        return tuple(stage % pp for stage in range(stages))
    return tuple(stage if stage < pp else 2 * pp - 1 - stage for stage in range(stages))


def _check_degrees(pp: int, vpp: int, placement: Placement) -> None:
    if pp < 1:
        raise ConfigError("pp", pp, "must be at least 1", "use pp >= 1")
    if vpp < 1:
        raise ConfigError("vpp", vpp, "must be at least 1", "use vpp >= 1")
    if placement is Placement.SINGLE and vpp != 1:
        raise ConfigError(
            "vpp", vpp, "single placement holds one stage per rank",
            "use vpp=1, or an interleaved schedule (looped placement) for vpp > 1",
        )
    if placement is Placement.V and vpp != 2:
        raise ConfigError(
            "vpp", vpp, "V placement holds exactly two stages per rank (r and 2*pp-1-r)",
            "use vpp=2 with ZB-V and DualPipeV",
        )


@dataclass(frozen=True)
class StagePartition:
    """Layers per stage and ranks per stage; answers placement queries both ways."""

    pp: int
    vpp: int
    placement: Placement
    stage_layers: tuple[range, ...]
    stage_ranks: tuple[int, ...]
    stage_costs: tuple[float, ...]

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def num_layers(self) -> int:
        return self.stage_layers[-1].stop

    @property
    def embedding_stage(self) -> int:
        return 0

    @property
    def head_stage(self) -> int:
        return self.num_stages - 1

    def stage_of_layer(self, layer: int) -> int:
        if not 0 <= layer < self.num_layers:
            raise ConfigError(
                "layer", layer, f"the model has layers 0..{self.num_layers - 1}",
                "ask for a layer inside the model",
            )
        starts = [layers.start for layers in self.stage_layers]
        stage = bisect.bisect_right(starts, layer) - 1
        # Empty stages share a start with the next one; step to the one that holds the layer.
        while layer not in self.stage_layers[stage]:
            stage += 1
        return stage

    def rank_of_layer(self, layer: int) -> int:
        return self.stage_ranks[self.stage_of_layer(layer)]

    def stages_of_rank(self, rank: int) -> list[int]:
        return [stage for stage, owner in enumerate(self.stage_ranks) if owner == rank]

    def layers_of_rank(self, rank: int) -> list[int]:
        return [layer for stage in self.stages_of_rank(rank) for layer in self.stage_layers[stage]]

    def rank_costs(self) -> list[float]:
        costs = [0.0] * self.pp
        for stage, cost in enumerate(self.stage_costs):
            costs[self.stage_ranks[stage]] += cost
        return costs


def partition_layers(
    layer_costs: Sequence[float],
    pp: int,
    vpp: int = 1,
    placement: Placement = Placement.SINGLE,
    embedding_cost: float = 0.0,
    head_cost: float = 0.0,
    layout: Sequence[int] | Sequence[Sequence[int]] | None = None,
) -> StagePartition:
    """Cut layers into pp * vpp stages and place the stages on ranks.

    layer_costs: one cost per transformer layer (any unit: FLOPs, seconds).
    layout: None for a cost-balanced cut, or an explicit one: either a layer count per stage
        (`[8, 7, 7, 8]`) or the layer indices of every stage (`[[0, 1], [2, 3, 4], ...]`).
    """
    placement = Placement(placement)
    ranks = stage_ranks(pp, vpp, placement)
    costs = [float(cost) for cost in layer_costs]
    for name, value in [("embedding_cost", embedding_cost), ("head_cost", head_cost)] + [
        (f"layer_costs[{i}]", c) for i, c in enumerate(costs)
    ]:
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(name, value, "costs must be finite and non-negative", "fix the cost")
    num_stages = pp * vpp
    if layout is None:
        stage_layers = _balanced_cut(costs, num_stages, embedding_cost, head_cost, pp, vpp)
    else:
        stage_layers = _validated_layout(layout, len(costs), num_stages, pp, vpp)
    stage_costs = tuple(
        sum(costs[layer] for layer in layers)
        + (embedding_cost if stage == 0 else 0.0)
        + (head_cost if stage == num_stages - 1 else 0.0)
        for stage, layers in enumerate(stage_layers)
    )
    return StagePartition(pp, vpp, placement, stage_layers, ranks, stage_costs)


def _balanced_cut(
    costs: list[float], num_stages: int, embedding_cost: float, head_cost: float, pp: int, vpp: int
) -> tuple[range, ...]:
    count = len(costs)
    if count < num_stages:
        raise ConfigError(
            "layers", count,
            f"{num_stages} stages (pp={pp} x vpp={vpp}) need at least one layer each",
            "lower pp or vpp, or pass an explicit layout that leaves the first or last stage "
            "with only the embedding or head",
        )
    # The embedding and head ride with the first and last layer: they can only be on those stages.
    items = list(costs)
    items[0] += embedding_cost
    items[-1] += head_cost
    prefix = [0.0]
    for cost in items:
        prefix.append(prefix[-1] + cost)
    limit = _smallest_feasible_limit(items, prefix, num_stages)
    slack = 1e-9 * max(1.0, prefix[-1])

    def reach(start: int) -> int:
        """The furthest end such that items[start:end] costs at most `limit`."""
        return max(start + 1, bisect.bisect_right(prefix, prefix[start] + limit + slack) - 1)

    # need[i]: fewest stages that can hold items[i:] within the limit (greedy is optimal here).
    need = [0] * (count + 1)
    for start in range(count - 1, -1, -1):
        need[start] = 1 + need[reach(start)]

    cuts, start = [], 0
    for stages_left in range(num_stages, 0, -1):
        if stages_left == 1:
            end = count
        else:
            target = (prefix[count] - prefix[start]) / stages_left
            candidates = [
                end
                for end in range(start + 1, reach(start) + 1)
                if need[end] <= stages_left - 1 <= count - end
            ]
            end = min(candidates, key=lambda e: (abs(prefix[e] - prefix[start] - target), e))
        cuts.append(range(start, end))
        start = end
    return tuple(cuts)


def _smallest_feasible_limit(items: list[float], prefix: list[float], num_stages: int) -> float:
    """Binary search for the least max-stage cost with which `num_stages` stages suffice."""

    def stages_needed(limit: float) -> int:
        stages, start, slack = 0, 0, 1e-9 * max(1.0, prefix[-1])
        while start < len(items):
            start = max(start + 1, bisect.bisect_right(prefix, prefix[start] + limit + slack) - 1)
            stages += 1
        return stages

    low, high = max(items), prefix[-1]
    for _ in range(100):
        if high - low <= 1e-12 * max(1.0, high):
            break
        middle = (low + high) / 2
        if stages_needed(middle) <= num_stages:
            high = middle
        else:
            low = middle
    return high


def _validated_layout(
    layout: Sequence[int] | Sequence[Sequence[int]], num_layers: int, num_stages: int, pp: int, vpp: int
) -> tuple[range, ...]:
    entries = list(layout)
    if len(entries) != num_stages:
        raise ConfigError(
            "layout", _short(layout),
            f"has {len(entries)} stages but pp={pp} x vpp={vpp} needs {num_stages}",
            f"give exactly {num_stages} entries, one per stage in stage order",
        )
    if all(isinstance(entry, int) for entry in entries):
        if any(entry < 0 for entry in entries):
            raise ConfigError("layout", _short(layout), "layer counts cannot be negative", "use counts >= 0")
        if sum(entries) != num_layers:
            raise ConfigError(
                "layout", _short(layout),
                f"the counts add up to {sum(entries)} layers but the model has {num_layers}",
                f"make the counts sum to {num_layers}",
            )
        stage_layers, start = [], 0
        for count in entries:
            stage_layers.append(range(start, start + count))
            start += count
    else:
        stage_layers = [_stage_range(stage, entry, num_layers) for stage, entry in enumerate(entries)]
        _check_order_and_cover(stage_layers, num_layers)
    for stage, layers in enumerate(stage_layers):
        if len(layers) == 0 and 0 < stage < num_stages - 1:
            raise ConfigError(
                "layout", _short(layout),
                f"stage {stage} holds no layers; only the first and last stage may hold just "
                "the embedding or the head",
                "give every middle stage at least one layer, or use fewer stages",
            )
    return tuple(stage_layers)


def _stage_range(stage: int, entry, num_layers: int) -> range:
    try:
        layers = [int(layer) for layer in entry]
    except TypeError:
        raise ConfigError(
            "layout", entry, f"stage {stage}: expected a layer count or a list of layer indices",
            "use counts like [8, 7, 7, 8] or index lists like [[0, 1, 2], [3, 4], ...]",
        ) from None
    for layer in layers:
        if not 0 <= layer < num_layers:
            raise ConfigError(
                "layout", entry, f"stage {stage} names layer {layer} but the model has layers "
                f"0..{num_layers - 1}", "use layer indices inside the model",
            )
    if layers and layers != list(range(layers[0], layers[0] + len(layers))):
        raise ConfigError(
            "layout", entry,
            f"stage {stage} holds layers {layers}, which are not consecutive; activations flow "
            "through stages in model order, so a stage must be one run of layers",
            "give each stage a contiguous, increasing run of layers",
        )
    return range(layers[0], layers[-1] + 1) if layers else range(0, 0)


def _check_order_and_cover(stage_layers: list[range], num_layers: int) -> None:
    owner: dict[int, int] = {}
    for stage, layers in enumerate(stage_layers):
        for layer in layers:
            if layer in owner:
                raise ConfigError(
                    "layout", f"stage {stage}", f"layer {layer} is on both stage {owner[layer]} "
                    f"and stage {stage}", "put every layer on exactly one stage",
                )
            owner[layer] = stage
    missing = [layer for layer in range(num_layers) if layer not in owner]
    if missing:
        raise ConfigError(
            "layout", f"layers {_short(missing)}", "are on no stage",
            "put every layer on exactly one stage",
        )
    next_layer = 0
    for stage, layers in enumerate(stage_layers):
        if layers:
            if layers.start != next_layer:
                raise ConfigError(
                    "layout", f"stage {stage}", f"starts at layer {layers.start} but the stages "
                    f"before it end at layer {next_layer - 1}",
                    "list stages in model order: stage s + 1 starts where stage s ends",
                )
            next_layer = layers.stop
        stage_layers[stage] = layers if layers else range(next_layer, next_layer)


def parse_layout(text: str) -> list[int] | list[list[int]]:
    """Parse a CLI layout: counts "8,7,7,8" or inclusive ranges "0-7,8-14,15,16-29"."""
    parts = [part.strip() for part in text.split(",")]
    try:
        if not any("-" in part for part in parts):
            return [int(part) for part in parts]
        stages = []
        for part in parts:
            first, _, last = part.partition("-")
            stages.append(list(range(int(first), int(last or first) + 1)))
        return stages
    except ValueError:
        raise ConfigError(
            "layout", text, "is neither layer counts nor layer ranges",
            'write counts per stage ("8,7,7,8") or inclusive ranges per stage ("0-7,8-14,15-21,22-29")',
        ) from None


def _short(value) -> str:
    text = repr(list(value)) if not isinstance(value, str) else value
    return text if len(text) <= 80 else text[:77] + "..."
