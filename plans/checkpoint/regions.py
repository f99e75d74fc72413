"""Which piece of every global tensor each rank of a layout holds, predicted without torch.distributed.

The reshard planner needs the target ranks' regions before any target rank exists (dry runs,
offline resharding, a 768-rank plan on a laptop), so this module states the sharding rules as
data and computes regions with plain integers. They are the rules the actors apply with DTensor
(`actors/parallel/parallelize.py` and FSDP2); tests check every rank's prediction against torch's own
`compute_local_shape_and_global_offset` for many layouts, so the two cannot drift apart.

Rules, in the order the actors apply them:
- tp: the split dimension comes from the TP plan both sides read (`plans/training/tp_plan.py`):
  fused qkv, gate_up, the embedding and the LM head are split by rows (dim 0) into tp blocks
  with torch.chunk's sizes, as DTensor's Shard cuts them (equal, except a vocabulary tp does not
  divide: the last ranks hold fewer rows, docs/decisions.md 118); wo and down by columns (dim 1);
  norm weights are copied on every tp rank.
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

import numpy as np

from rayshard.plans.checkpoint.replicas import read_once_readers, read_once_readers_by_copies
from rayshard.plans.checkpoint.reshard import Target
from rayshard.plans.checkpoint.target_table import READS_ITSELF, TargetTable
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout, RankCoords
from rayshard.plans.pipeline.partition import StagePartition
from rayshard.plans.pipeline.plan import stage_partition
from rayshard.plans.pipeline.schedules import schedule_for_vpp
from rayshard.plans.training.model_plan import stage_part
from rayshard.plans.training.model_spec import ModelConfig, check_experts_fit, parameter_shapes
from rayshard.plans.training.tp_fit import check_tp_fits
from rayshard.plans.training.tp_plan import split_dim_under

EMBEDDING = "tok_embeddings.weight"


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
def _stage_parts(model: ModelConfig) -> tuple[tuple[str, ...], dict[int, tuple[str, ...]], tuple[str, ...]]:
    """The parameters only the first stage holds, each block's, and those only the last stage
    holds, as the model's plan cuts them (`ModelPlan.first_stage`, `blocks`, `last_stage`)."""
    plan = model.plan
    first, layers, last = [], {}, []
    for name in _shapes(model):
        part = stage_part(plan, name)
        if part == "first":
            first.append(name)
        elif part == "last":
            last.append(name)
        else:
            layers.setdefault(part, []).append(name)
    return tuple(first), {layer: tuple(names) for layer, names in layers.items()}, tuple(last)


def rank_tensor_names(model: ModelConfig, layout: ParallelLayout, pp_rank: int,
                      partition: StagePartition | None) -> list[tuple[str, bool]]:
    """(global name, is the tied copy) of every parameter pipeline rank `pp_rank` holds, in module order."""
    shapes = _shapes(model)
    if layout.pp == 1 or partition is None:
        return [(name, False) for name in shapes]
    stages = partition.stages_of_rank(pp_rank)
    first = partition.embedding_stage in stages
    last = partition.head_stage in stages
    first_only, by_layer, last_only = _stage_parts(model)
    names: list[tuple[str, bool]] = [(name, False) for name in first_only] if first else []
    for layer in partition.layers_of_rank(pp_rank):
        names += [(name, False) for name in by_layer.get(layer, ())]
    if last:
        if model.tie_embeddings and not first:
            names.append((EMBEDDING, True))
        names += [(name, False) for name in last_only]
    return names


def tensor_region(name: str, shape: tuple[int, ...], layout: ParallelLayout, coords: RankCoords,
                  tp_styles: tuple[tuple[str, str], ...] | None = None) -> Region:
    """Where rank `coords` sits in tensor `name` (any pp coordinate that holds it); tp_styles: the
    model's tp plan (`ModelConfig.tp_styles`; None: the reference model's)."""
    offsets, sizes = [0] * len(shape), list(shape)
    split = split_dim_under(name, tp_styles or ModelConfig().tp_styles) if layout.tp > 1 else None
    if split is not None:
        start, stop = chunk_bounds(shape[split], layout.tp, coords.tp)
        offsets[split], sizes[split] = start, stop - start
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
        region = tensor_region(name, shapes[name], layout, coords, model.tp_styles)
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


def layout_target_table(model: ModelConfig, layout: ParallelLayout, kinds: Sequence[str],
                        partition: StagePartition | None = None, read_once: bool = True,
                        itemsize: int = 4) -> TargetTable:
    """`layout_targets` as columns, without a record per piece (874k pieces at 12,288 ranks).

    A stage's regions are computed for every (fsdp, tp) coordinate at once (`_grid_regions`:
    `tensor_region`'s rules over arrays), and a read-once split once per (pp, fsdp, tp): the
    split's salt and the readers' ranks do not depend on the dp coordinate, so every dp replica
    gets the one `read_once_readers` computes for its dp-0 peer. Tests hold both functions to the
    same rows on many layouts."""
    if layout.pp > 1 and partition is None:
        partition = pipeline_partition(model, layout)
    shapes = _shapes(model)
    names = list(shapes)
    code_of = {name: code for code, name in enumerate(names)}
    kinds = list(kinds)
    width = max([1] + [len(shape) for shape in shapes.values()])
    dp, fsdp, tp = layout.dp, layout.fsdp, layout.tp
    columns: dict[str, list[np.ndarray]] = {key: [] for key in ("rank", "name", "kind", "ndim", "offsets", "sizes", "reader")}
    for pp in range(layout.pp):
        held = rank_tensor_names(model, layout, pp, partition)
        if not held:
            continue
        grids = [_grid_regions(name, shapes[name], layout, width, model.tp_styles) for name, _ in held]
        offsets = np.stack([g[0] for g in grids], axis=2)  # (fsdp, tp, regions, width)
        sizes = np.stack([g[1] for g in grids], axis=2)
        copies = [g[2] for g in grids]
        ndim = np.array([len(shapes[name]) for name, _ in held], np.int64)
        used = np.arange(width) < ndim[:, None]
        numel = np.where(used, sizes, 1).prod(axis=3)  # (fsdp, tp, regions)
        shape5 = (dp, fsdp, tp, len(held), len(kinds))
        readers = np.full((fsdp, tp, len(held), len(kinds)), READS_ITSELF, np.int64)
        if read_once and dp > 1:
            for f in range(fsdp):
                for t in range(tp):
                    kept = np.flatnonzero(numel[f, t] > 0).tolist()
                    pieces = [(r, kind) for r in kept for kind in range(len(kinds))]
                    split = read_once_readers_by_copies([copies[r] for r, _ in pieces],
                                                        [int(numel[f, t, r]) * itemsize for r, _ in pieces],
                                                        layout, RankCoords(pp, 0, f, t))
                    for (r, kind), reader in zip(pieces, split):
                        readers[f, t, r, kind] = READS_ITSELF if reader is None else reader
        ranks = layout.rank_of(RankCoords(pp, 0, 0, 0)) + np.arange(dp * fsdp * tp).reshape(dp, fsdp, tp)
        rank = np.broadcast_to(ranks[:, :, :, None, None], shape5)
        reader = np.where(readers[None] == rank, READS_ITSELF, readers[None])
        keep = np.broadcast_to((numel > 0)[None, :, :, :, None], shape5)
        columns["rank"].append(rank[keep])
        columns["reader"].append(reader[keep])
        name_codes = np.array([code_of[name] for name, _ in held], np.int32)
        columns["name"].append(np.broadcast_to(name_codes[None, None, None, :, None], shape5)[keep])
        columns["kind"].append(np.broadcast_to(np.arange(len(kinds), dtype=np.int32), shape5)[keep])
        columns["ndim"].append(np.broadcast_to(ndim[None, None, None, :, None], shape5)[keep])
        columns["offsets"].append(np.broadcast_to(offsets[None, :, :, :, None], (*shape5, width))[keep])
        columns["sizes"].append(np.broadcast_to(sizes[None, :, :, :, None], (*shape5, width))[keep])
    empty = {"rank": np.int64, "reader": np.int64, "name": np.int32, "kind": np.int32, "ndim": np.int64}
    joined = {key: np.concatenate(parts) if parts else np.zeros(0, empty.get(key, np.int64)) for key, parts in columns.items()}
    for key in ("offsets", "sizes"):
        if not columns[key]:
            joined[key] = np.zeros((0, width), np.int64)
    return TargetTable(layout.world_size, names, kinds, joined["rank"], joined["name"], joined["kind"], joined["ndim"],
                       joined["offsets"], joined["sizes"], joined["reader"], np.full(len(joined["rank"]), itemsize, np.int64))


def _grid_regions(name: str, shape: tuple[int, ...], layout: ParallelLayout, width: int,
                  tp_styles: tuple[tuple[str, str], ...]) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """`tensor_region` for every (fsdp, tp) coordinate at once: offsets and sizes (fsdp, tp, width)."""
    offsets = np.zeros((layout.fsdp, layout.tp, width), np.int64)
    sizes = np.zeros((layout.fsdp, layout.tp, width), np.int64)
    sizes[:, :, :len(shape)] = shape
    split = split_dim_under(name, tp_styles) if layout.tp > 1 else None
    if split is not None:
        block = -(-shape[split] // layout.tp)  # torch.chunk's cut, as DTensor's Shard (`chunk_bounds`)
        start = np.minimum(shape[split], block * np.arange(layout.tp))
        offsets[:, :, split] = start[None, :]
        sizes[:, :, split] = (np.minimum(shape[split], start + block) - start)[None, :]
    if layout.data_parallel_size > 1 and shape:
        length = sizes[:, :, 0].copy()  # torch.chunk's cut of the tp-local piece (`chunk_bounds`)
        size = -(-length // layout.fsdp)
        start = np.minimum(length, size * np.arange(layout.fsdp)[:, None])
        offsets[:, :, 0] += start
        sizes[:, :, 0] = np.minimum(length, start + size) - start
    replicated = (("dp",) if layout.dp > 1 else ()) + (("tp",) if layout.tp > 1 and split is None else ())
    return offsets, sizes, replicated


def check_layout_fits(model: ModelConfig, layout: ParallelLayout) -> None:
    """The model-shape constraints a layout must meet to hold this model (the same ones training checks)."""
    check_tp_fits(model, layout.tp, "tp", "tp")  # a user model: each parameter tp splits, from its record
    check_experts_fit(model, layout)
    if layout.pp * layout.vpp > model.n_layers:
        raise ConfigError("pp", layout.pp, f"pp*vpp = {layout.pp * layout.vpp} stages exceed the model's {model.n_layers} layers",
                          "lower pp or vpp")
