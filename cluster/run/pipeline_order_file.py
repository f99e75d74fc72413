"""Reading a pipeline order file (torch.distributed.pipelining's CSV) for `plans/pipeline/csv_order.py`."""
from __future__ import annotations

import csv

import fsspec

from rayshard.plans.errors import ConfigError


def read_csv_rows(path) -> tuple[tuple[str, ...], ...]:
    """The file's cells, one tuple per rank; a local path or an fsspec URL."""
    try:
        with fsspec.open(str(path), "r", newline="") as handle:
            return tuple(tuple(row) for row in csv.reader(handle))
    except FileNotFoundError:
        raise ConfigError("--schedule-csv", str(path), "file not found",
                          "pass a CSV with one row of actions per pipeline rank, e.g. `0F0,0F1,0B0,0B1`") from None
    except (UnicodeDecodeError, csv.Error) as error:
        raise ConfigError("--schedule-csv", str(path), f"is not a readable CSV text file ({error})",
                          "pass a CSV with one row of actions per pipeline rank, e.g. `0F0,0F1,0B0,0B1`") from None
