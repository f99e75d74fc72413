"""The data section: where the tokens come from and how ranks read them ahead."""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.options import file_only, option


@dataclass(frozen=True)
class DataConfig:
    """The corpus or prepared dataset, and the background reads that keep a step from waiting.

    source: "stdlib", a file, a directory, a glob or an fsspec URL (or a prepared dataset's);
    max_bytes: how much of a text source to read. dataset: a prepared dataset's URL (`rayshard
    data prepare --out`); training then reads its tokens. prefetch_steps: batches of later steps
    each rank reads ahead in a background thread; read_timeout_s: how long one may take.
    """

    source: str = option("stdlib", flag="--data", metavar="SOURCE",
                         help="'stdlib', a file, directory, glob or fsspec URL; a prepared dataset's URL; "
                              "or weighted datasets, URL=0.7,URL=0.3")
    max_bytes: int = file_only(8_000_000)
    dataset: str | None = file_only(None)
    prefetch_steps: int = file_only(4)
    read_timeout_s: float = file_only(600.0)

    def validate(self, seq_len: int) -> None:
        if self.max_bytes < seq_len + 2:
            raise ConfigError("data.max_bytes", self.max_bytes, "the corpus must hold at least one sequence",
                              f"set data.max_bytes above {seq_len + 1}")
        if self.prefetch_steps < 0:
            raise ConfigError("data.prefetch_steps", self.prefetch_steps, "must be >= 0 (0 reads each batch when needed)",
                              "set data.prefetch_steps to 0 or more")
        if self.read_timeout_s <= 0:
            raise ConfigError("data.read_timeout_s", self.read_timeout_s, "must be positive", "set it to e.g. 600")
