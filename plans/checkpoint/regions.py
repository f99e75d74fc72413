"""Which piece of every global tensor each rank of a layout holds, predicted without torch.distributed.

The reshard planner needs the target ranks' regions before any target rank exists (dry runs,
offline resharding, a 768-rank plan on a laptop), so this module states the sharding rules as
data and computes regions with plain integers. They are the rules the actors apply with DTensor
(`actors/model/parallelize.py` and FSDP2); tests check every rank's prediction against torch's own
`compute_local_shape_and_global_offset` for many layouts, so the two cannot drift apart.

Rules, in the order the actors apply them:
- tp: the split dimension comes from the TP plan both sides read (`plans/training/tp_plan.py`):
  fused qkv, gate_up, the embedding and the LM head are split by rows (dim 0) into tp equal
  blocks; wo and down by columns (dim 1); norm weights are copied on every tp rank.
- fsdp: the (tp-local) piece is then cut along dim 0 into fsdp chunks with torch.chunk's sizes
  (ceil(n / fsdp) each, the last ones shorter or empty); dp replicas hold identical copies.
- pp: a rank holds the layers of its stages; the first stage's rank holds the embedding, the last
  stage's rank the final norm and the LM head (with tied embeddings: the embedding again, a copy
  of the first stage's piece).
"""
from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from plans.checkpoint.replicas import read_once_readers
from plans.checkpoint.reshard import Target
from plans.errors import ConfigError
from plans.layout.parallel_layout import ParallelLayout, RankCoords
from plans.pipeline.partition import StagePartition
from plans.pipeline.plan import stage_partition
from plans.pipeline.schedules import schedule_for_vpp
from plans.training.model_spec import ModelConfig, parameter_shapes
from plans.training.tp_plan import tp_split_dim

EMBEDDING = "tok_embeddings.weight"
HEAD_ONLY = ("norm.weight", "output.weight")


@dataclass(frozen=True)
class Region:
    """One rank's piece of one global tensor, in global coordinates."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    # Mesh dims along which other ranks hold an identical copy (their writer is chosen among them).
    replicated_over: tuple[str, ...]
    # True for the tied embedding's copy on the last stage: never written, the first stage writes it.
    tied_copy: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def chunk_bounds(length: int, pieces: int, index: int) -> tuple[int, int]:
    """[start, stop) of piece `index` when torch.chunk cuts `length` into `pieces` (may be empty)."""
    size = -(-length // pieces)
    start = min(length, size * index)
    return start, min(length, start + size)


def pipeline_partition(model: ModelConfig, layout: ParallelLayout, schedule: str = "1f1b",
                       stage_layout: Sequence[int] | None = None) -> StagePartition:
    """The trainer's own stage cut (`plans/pipeline/plan.py`): the schedule decides how stages map
    to pp ranks (single, looped for vpp, or V); `stage_layout` gives layer counts per stage."""
    return stage_partition(model, layout, schedule_for_vpp(schedule, layout.vpp), stage_layout)


@lru_cache(maxsize=64)
def _shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    return parameter_shapes(model)


@lru_cache(maxsize=64)
def _names_by_layer(model: ModelConfig) -> dict[int, tuple[str, ...]]:
    layers: dict[int, list[str]] = {}
    for name in _shapes(model):
        if name.startswith("layers."):
            layers.setdefault(int(name.split(".")[1]), []).append(name)
    return {layer: tuple(names) for layer, names in layers.items()}


def rank_tensor_names(model: ModelConfig, layout: ParallelLayout, pp_rank: int,
                      partition: StagePartition | None) -> list[tuple[str, bool]]:
    """(global name, is the tied copy) of every parameter pipeline rank `pp_rank` holds, in module order."""
    shapes = _shapes(model)
    if layout.pp == 1 or partition is None:
        return [(name, False) for name in shapes]
    stages = partition.stages_of_rank(pp_rank)
    first = partition.embedding_stage in stages
    last = partition.head_stage in stages
    names: list[tuple[str, bool]] = []
    if first:
        names.append((EMBEDDING, False))
    by_layer = _names_by_layer(model)
    for layer in partition.layers_of_rank(pp_rank):
        names += [(name, False) for name in by_layer.get(layer, ())]
    if last:
        if model.tie_embeddings and not first:
            names.append((EMBEDDING, True))
        names += [(name, False) for name in HEAD_ONLY if name in shapes]
    return names


def tensor_region(name: str, shape: tuple[int, ...], layout: ParallelLayout, coords: RankCoords) -> Region:
    """Where rank `coords` sits in tensor `name` (any pp coordinate that holds it)."""
    offsets, sizes = [0] * len(shape), list(shape)
    split = tp_split_dim(name) if layout.tp > 1 else None
    if split is not None:
        block = shape[split] // layout.tp
        offsets[split], sizes[split] = coords.tp * block, block
    if layout.data_parallel_size > 1 and shape:
        # FSDP2 cuts the tp-local piece along dim 0 (a strided shard when tp also split dim 0).
        start, stop = chunk_bounds(sizes[0], layout.fsdp, coords.fsdp)
        offsets[0], sizes[0] = offsets[0] + start, stop - start
    replicated = []
    if layout.dp > 1:
        replicated.append("dp")
    if layout.tp > 1 and split is None:
        replicated.append("tp")
    return Region(name, tuple(shape), tuple(offsets), tuple(sizes), tuple(replicated))


def rank_regions(model: ModelConfig, layout: ParallelLayout, rank: int,
                 partition: StagePartition | None = None) -> list[Region]:
    """Every parameter region rank `rank` holds (optimizer moments share them), in module order."""
    coords = layout.coords_of(rank)
    if layout.pp > 1 and partition is None:
        partition = pipeline_partition(model, layout)
    # Ranks that differ only in dp hold the same regions: a 768-rank plan computes each once.
    return list(_rank_regions_cached(model, layout, RankCoords(coords.pp, 0, coords.fsdp, coords.tp), partition))


@lru_cache(maxsize=4096)
def _rank_regions_cached(model, layout, coords, partition) -> tuple[Region, ...]:
    shapes = _shapes(model)
    regions = []
    for name, tied in rank_tensor_names(model, layout, coords.pp, partition):
        region = tensor_region(name, shapes[name], layout, coords)
        if tied:
            region = Region(region.name, region.global_shape, region.offsets, region.sizes,
                            region.replicated_over, tied_copy=True)
        regions.append(region)
    return tuple(regions)


def layout_targets(model: ModelConfig, layout: ParallelLayout, kinds: Sequence[str],
                   partition: StagePartition | None = None, read_once: bool = True,
                   itemsize: int = 4) -> list[list[Target]]:
    """For every rank of the layout, the (name, kind, region) pieces it must fill on load.

    read_once: replicas (across dp, and across tp too for pieces copied there) hold identical
    pieces, so each replica group reads each piece once (readers balanced by bytes, as writers
    are on save) and the reader broadcasts it; without it, every replica reads everything and
    storage serves the checkpoint dp times or more."""
    targets = []
    for rank in range(layout.world_size):
        coords = layout.coords_of(rank)
        pieces = [(region, kind) for region in rank_regions(model, layout, rank, partition) if region.numel for kind in kinds]
        readers = read_once_readers([r for r, _ in pieces], [r.numel * itemsize for r, _ in pieces], layout, coords) \
            if read_once else [None] * len(pieces)
        targets.append([Target(region.name, kind, region.offsets, region.sizes, None if reader in (None, rank) else reader, itemsize)
                        for (region, kind), reader in zip(pieces, readers)])
    return targets


def check_layout_fits(model: ModelConfig, layout: ParallelLayout) -> None:
    """The model-shape constraints a layout must meet to hold this model (the same ones training checks)."""
    for what, count in (("the number of kv heads", model.n_kv_heads), ("model.ffn_dim", model.ffn_dim),
                        ("model.vocab_size", model.vocab_size)):
        if count % layout.tp:
            divisors = [d for d in range(1, count + 1) if count % d == 0]
            raise ConfigError("tp", layout.tp, f"must divide {what} ({count})", f"use tp in {divisors}")
    if layout.pp * layout.vpp > model.n_layers:
        raise ConfigError("pp", layout.pp, f"pp*vpp = {layout.pp * layout.vpp} stages exceed the model's {model.n_layers} layers",
                          "lower pp or vpp")
