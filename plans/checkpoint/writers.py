"""The pieces every rank of a layout would write when saving, predicted without torch.distributed
(dry runs, offline resharding, synthetic manifests). Which replica writes a piece is
`plans/checkpoint/replicas.py`'s `pieces_written`, the same function the actors' real save calls.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rayshard.plans.checkpoint.chunks import STATE_KINDS
from rayshard.plans.checkpoint.regions import Region, rank_regions
from rayshard.plans.checkpoint.replicas import pieces_written
from rayshard.plans.checkpoint.safetensors_layout import ITEMSIZE
from rayshard.plans.layout.parallel_layout import ParallelLayout, RankCoords
from rayshard.plans.pipeline.partition import StagePartition
from rayshard.plans.training.model_spec import ModelConfig


@dataclass(frozen=True)
class PlannedPiece:
    """A piece one rank writes: its tensor region, state kind and dtype."""

    region: Region
    kind: str
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.region.numel * ITEMSIZE[self.dtype]


def rank_writes(regions: Sequence[Region], kinds: Sequence[str], dtype: str, layout: ParallelLayout,
                coords: RankCoords) -> list[PlannedPiece]:
    """The pieces this rank writes, in the order its file holds them (`file_position`; module order
    within, each tensor's kinds together)."""
    pieces = [PlannedPiece(region, kind, dtype) for region in regions if not region.tied_copy and region.numel
              for kind in kinds]
    chosen = pieces_written([piece.region.replicated_over for piece in pieces], [piece.nbytes for piece in pieces],
                            layout, coords)
    return [pieces[index] for index in chosen]


def predicted_writes(model: ModelConfig, layout: ParallelLayout, partition: StagePartition | None = None,
                     kinds: Sequence[str] = STATE_KINDS, dtype: str = "float32") -> list[list[PlannedPiece]]:
    """For every rank, the pieces it would write when saving this model in this layout."""
    return [rank_writes(rank_regions(model, layout, rank, partition), kinds, dtype, layout, layout.coords_of(rank))
            for rank in range(layout.world_size)]
