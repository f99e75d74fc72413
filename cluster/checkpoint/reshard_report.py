"""What `rayshard ckpt plan` prints: a reshard plan's per-rank reads, totals and coverage proof."""
from __future__ import annotations

import re
import statistics
import time

import numpy as np

from rayshard.plans.checkpoint.chunk_table import ChunkTable, as_table
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.checkpoint.model_check import model_to_plan
from rayshard.plans.checkpoint.layout_plan import LayoutPlan, plan_layout
from rayshard.plans.checkpoint.column_bands import banded_target_table
from rayshard.plans.checkpoint.reshard import DEFAULT_MIN_SEGMENT_BYTES, index_chunks
from rayshard.plans.checkpoint.regions import check_layout_fits, layout_target_table

MiB = 2**20


def build_plan(chunks: ChunkTable | list[Chunk], metadata: dict, layout: ParallelLayout, partition=None,
               min_segment_bytes: int = DEFAULT_MIN_SEGMENT_BYTES, read_once: bool = True) -> tuple[LayoutPlan, float]:
    """(plan, seconds) for loading this checkpoint onto `layout`; metadata only, no data read."""
    started = time.perf_counter()
    model = model_to_plan(chunks, metadata, metadata.get("run", "to plan"))
    check_layout_fits(model, layout)
    chunks = as_table(chunks)  # columns: the plan makes records only for the chunks it reads
    held = chunks.kinds()
    kinds = [k for k in ("param", "exp_avg", "exp_avg_sq") if k in held]
    # Columns end to end (targets, overlaps, requests): a 12,288-rank plan makes no record per piece.
    targets = layout_target_table(model, layout, kinds, partition, read_once)
    # On a store that reads short row segments as whole rows, tp groups read row-parallel weights
    # as bands, once, as the load does (decision 146).
    targets = banded_target_table(targets, index_chunks(chunks), layout, min_segment_bytes, read_once)
    plan = plan_layout(chunks, targets, min_segment_bytes)
    return plan, time.perf_counter() - started


def format_plan(plan: LayoutPlan, layout: ParallelLayout, source: str, metadata: dict, seconds: float,
                files: int, show_ranks: int = 16) -> list[str]:
    source_layout = metadata.get("layout") or {}
    try:
        source_text = ParallelLayout.from_dict(source_layout).describe()
    except Exception:
        source_text = str(source_layout)
    lines = [f"reshard plan for {source}",
             f"  from {source_text} ({files} files, {plan.source_bytes / MiB:.2f} MiB) "
             f"to {layout.describe()} ({layout.world_size} ranks)",
             "  rank  coords                 pieces   needed MiB   read MiB   recv MiB  requests  files"]
    world = len(plan.ranks)
    shown = range(world) if world <= show_ranks else np.argsort(-plan.rank_bytes_read, kind="stable")[:5].tolist()
    for rank in shown:
        rank_plan = plan.ranks[rank]  # made for the ranks shown only
        c = layout.coords_of(rank_plan.rank)
        coords = f"pp{c.pp} dp{c.dp} fsdp{c.fsdp} tp{c.tp}"
        pieces = len(rank_plan.items) + len(rank_plan.received)
        needed = rank_plan.bytes_needed + rank_plan.bytes_received
        lines.append(f"  {rank_plan.rank:>4}  {coords:<22} {pieces:>6} {needed / MiB:>12.3f} "
                     f"{rank_plan.bytes_read / MiB:>10.3f} {rank_plan.bytes_received / MiB:>10.3f} "
                     f"{len(rank_plan.requests):>9} {rank_plan.files:>6}")
    if world > len(shown):
        reads = (plan.rank_bytes_read / MiB).tolist()
        requests = plan.rank_requests.tolist()
        lines.append(f"  ... the 5 heaviest of {world} ranks shown; read MiB per rank min {min(reads):.2f} "
                     f"median {statistics.median(reads):.2f} max {max(reads):.2f}; requests per rank min {min(requests)} "
                     f"median {statistics.median(requests):g} max {max(requests)}")
    amplification = plan.bytes_read / plan.bytes_needed if plan.bytes_needed else 1.0
    sharing = (f"{plan.bytes_received / MiB:.2f} MiB more reach replicas by broadcast, and tp ranks by scatter (each piece "
               "or band of whole rows read once per group)"
               if plan.bytes_received else "every rank reads what it holds (no broadcast)")
    lines += amplification_lines(plan)
    lines += [f"  total: {plan.bytes_read / MiB:.2f} MiB read from storage for {plan.bytes_needed / MiB:.2f} MiB needed "
              f"({amplification:.3f}x; {plan.bytes_read / max(1, plan.source_bytes):.2f}x the checkpoint) in {plan.requests} requests; "
              + sharing,
              f"  {plan.proof()}",
              f"  planned in {seconds:.3f}s from the manifest alone; no tensor data was read"]
    return lines


def weight_family(name: str, kind: str = "") -> str:
    """A tensor's name with its layer (and expert) numbers as `*`: every layer's `wo` is one family."""
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", name)


def _ratio(read: int, needed: int) -> str:
    return f"{read / needed:.3f}x" if needed else "-"


def amplification_lines(plan: LayoutPlan) -> list[str]:
    """Read amplification (bytes read / bytes needed) per state kind and per weight family, from
    the items' byte ranges before coalescing (header checks excluded: the total line has them)."""
    by_kind = plan.amplification_by(lambda name, kind: kind)
    by_family = plan.amplification_by(weight_family)
    if not by_kind:
        return []
    lines = ["  read amplification (bytes read / bytes needed) by state kind: "
             + ", ".join(f"{kind} {_ratio(*sums)}" for kind, sums in by_kind.items())]
    width = max(len(family) for family in by_family)
    lines.append("  by weight family:")
    lines += [f"    {family:<{width}}  {_ratio(read, needed):>8}  ({read / MiB:.2f} MiB read, {needed / MiB:.2f} needed)"
              for family, (read, needed) in by_family.items()]
    return lines
