"""Every target rank's pieces as columns: what a dry run plans over a whole layout.

A 12,288-rank layout of a 405B model has ~874k pieces (region x state kind); one `Target` record
each cost ~3 s to make and ~0.4 GiB on the driver before planning began. Here they are rows:
rank, tensor name and kind (dictionary codes), offsets and sizes (int64 matrices padded to the
widest region, `ndim` says how many columns count), the replica that reads the piece for this
rank (-1: the rank reads it itself) and the element size. Rows are in rank order, and within a
rank in the order `regions.layout_targets` lists them, so `targets_of(rank)` is that rank's list.

Pure: numpy only.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rayshard.plans.checkpoint.reshard import Target

READS_ITSELF = -1  # receive_from of a piece its own rank reads from storage


@dataclass
class TargetTable:
    world_size: int
    names: list[str]  # the values name_code indexes
    kinds: list[str]
    rank: np.ndarray  # int64, non-decreasing
    name_code: np.ndarray  # int32
    kind_code: np.ndarray  # int32
    ndim: np.ndarray  # int64
    offsets: np.ndarray  # (rows, width) int64, zero past ndim
    sizes: np.ndarray  # (rows, width) int64, zero past ndim
    receive_from: np.ndarray  # int64, READS_ITSELF or the global rank that reads it and broadcasts
    itemsize: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.rank)

    @property
    def width(self) -> int:
        return self.offsets.shape[1]

    def rank_bounds(self) -> np.ndarray:
        """[bounds[r], bounds[r + 1]) are rank r's rows."""
        return np.searchsorted(self.rank, np.arange(self.world_size + 1), "left")

    def volumes(self) -> np.ndarray:
        used = np.arange(self.width) < self.ndim[:, None]
        return np.where(used, self.sizes, 1).prod(axis=1)

    def targets_of(self, rank: int) -> list[Target]:
        """Rank `rank`'s pieces as `Target` records, in listed order (what `plan_rank` takes)."""
        low, high = np.searchsorted(self.rank, [rank, rank + 1], "left").tolist()
        rows = range(low, high)
        offsets, sizes = self.offsets[low:high].tolist(), self.sizes[low:high].tolist()
        ndim, names, kinds = self.ndim[low:high].tolist(), self.name_code[low:high].tolist(), self.kind_code[low:high].tolist()
        readers, itemsizes = self.receive_from[low:high].tolist(), self.itemsize[low:high].tolist()
        return [Target(self.names[names[i]], self.kinds[kinds[i]], tuple(offsets[i][:ndim[i]]), tuple(sizes[i][:ndim[i]]),
                       None if readers[i] == READS_ITSELF else readers[i], itemsizes[i])
                for i in range(len(rows))]

    def as_lists(self) -> list[list[Target]]:
        return [self.targets_of(rank) for rank in range(self.world_size)]

    @classmethod
    def from_lists(cls, targets_per_rank: Sequence[Sequence[Target]]) -> "TargetTable":
        """The table of per-rank `Target` lists (small layouts, tests, callers that built records)."""
        flat = [(rank, target) for rank, targets in enumerate(targets_per_rank) for target in targets]
        names: dict[str, int] = {}
        kinds: dict[str, int] = {}
        width = max([1] + [len(t.offsets) for _, t in flat])
        offsets = np.zeros((len(flat), width), np.int64)
        sizes = np.zeros((len(flat), width), np.int64)
        for row, (_, target) in enumerate(flat):
            offsets[row, :len(target.offsets)] = target.offsets
            sizes[row, :len(target.sizes)] = target.sizes
        name_code = np.fromiter((names.setdefault(t.name, len(names)) for _, t in flat), np.int32, len(flat))
        kind_code = np.fromiter((kinds.setdefault(t.kind, len(kinds)) for _, t in flat), np.int32, len(flat))
        return cls(len(targets_per_rank), list(names), list(kinds),
                   np.fromiter((rank for rank, _ in flat), np.int64, len(flat)), name_code, kind_code,
                   np.fromiter((len(t.offsets) for _, t in flat), np.int64, len(flat)), offsets, sizes,
                   np.fromiter((READS_ITSELF if t.receive_from is None else t.receive_from for _, t in flat), np.int64, len(flat)),
                   np.fromiter((t.itemsize for _, t in flat), np.int64, len(flat)))
