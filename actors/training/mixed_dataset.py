"""A rank's view of several prepared datasets mixed with weights: each row's dataset and sample come
from `plans/data/mixture.py`, and each dataset is read by byte ranges as it would be alone."""
from __future__ import annotations

import numpy as np
import torch

from rayshard.actors.training.dataset_reader import PreparedDataset
from rayshard.plans.data.dataset_index import DatasetIdentity
from rayshard.plans.data.mixture import Mixture, mixed_batch_ids
from rayshard.plans.errors import ConfigError


class MixedDataset:
    def __init__(self, mixture: Mixture, seq_len: int):
        self.mixture = mixture
        self.parts = [PreparedDataset(url, seq_len) for url in mixture.urls]
        tokenizers = {part.meta.tokenizer_hash for part in self.parts}
        if len(tokenizers) > 1:  # the same id would mean different text in different rows
            named = ", ".join(f"{part.url} ({part.meta.tokenizer_hash})" for part in self.parts)
            raise ConfigError("data.dataset", mixture.text(), f"mixes datasets of different tokenizers: {named}",
                              "prepare every dataset of a mixture with the same --tokenizer")
        self.meta = self.parts[0].meta  # vocabulary and tokenizer: the same for every part
        self.sample_counts = tuple(part.samples for part in self.parts)

    def identities(self) -> list[DatasetIdentity]:
        return [part.identity() for part in self.parts]

    def batch_ids(self, seed: int, step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
        return mixed_batch_ids(seed, step, batch, self.sample_counts, self.mixture.weights)

    def rank_windows(self, seed: int, step: int, batch: int, data_rank: int, data_ranks: int) -> torch.Tensor:
        """This data rank's contiguous rows of global batch `step`: [rows, seq_len + 1] int64."""
        per_rank = batch // data_ranks
        rows = slice(data_rank * per_rank, (data_rank + 1) * per_rank)
        datasets, samples = (ids[rows] for ids in self.batch_ids(seed, step, batch))
        windows = np.empty((per_rank, self.parts[0].seq_len + 1), dtype=np.int64)
        for dataset in np.unique(datasets):
            chosen = datasets == dataset
            windows[chosen] = self.parts[int(dataset)].read_samples(samples[chosen])
        return torch.from_numpy(windows)
