"""The driver's side of training on a prepared dataset: checks before any rank starts, what a
checkpoint records of the data, and one hash per step of the global batch.
"""
from __future__ import annotations

from actors.training.dataset_reader import PreparedDataset
from actors.training.dataset_source import prepared_dataset_url
from actors.training.reports import StepMetrics
from plans.config import TrainConfig
from plans.data.batch_hash import global_batch_hash
from plans.data.compatibility import check_same_dataset, check_vocab_fits
from plans.data.errors import DatasetMismatch
from plans.data.dataset_index import DatasetIdentity
from plans.layout.parallel_layout import ParallelLayout


def training_dataset(config: TrainConfig) -> DatasetIdentity | None:
    """The prepared dataset the run trains on (None: byte-level text), read from its index now."""
    url = prepared_dataset_url(config)
    return None if url is None else PreparedDataset(url, config.seq_len).identity()


def check_training_data(config: TrainConfig, resumed_metadata: dict | None, checkpoint_url: str | None) -> None:
    """Refuse a model too small for the tokenizer, and a resume whose data is not the checkpoint's."""
    url = prepared_dataset_url(config)
    recorded = ((resumed_metadata or {}).get("data_position") or {}).get("dataset")
    if url is None:
        if recorded is not None:  # trained on a prepared dataset, resumed on text: the data would change
            raise DatasetMismatch(
                f"{checkpoint_url} was trained on dataset {recorded.get('url')} (index hash {recorded.get('index_hash')}), "
                f"but this run reads text from {config.data.source!r}. Fix: pass --data {recorded.get('url')}, or start a new --run")
        return
    dataset = PreparedDataset(url, config.seq_len)
    check_vocab_fits(config.model.vocab_size, dataset.meta.vocab_size, url)
    if recorded is not None:
        check_same_dataset(recorded, dataset.identity(), checkpoint_url)


def dataset_record(config: TrainConfig) -> dict | None:
    """What checkpoint metadata's data_position records of a prepared dataset."""
    identity = training_dataset(config)
    return None if identity is None else identity.to_dict()


def step_batch_hash(per_rank: list[StepMetrics], layout: ParallelLayout) -> str:
    """The global batch's hash from the ranks' row digests: one rank per data rank, in data-rank order
    (tp and pipeline peers hold the same rows)."""
    by_data_rank: dict[int, str] = {}
    for rank, metrics in enumerate(per_rank):
        by_data_rank.setdefault(layout.data_rank_of(rank), metrics.batch_hash)
    return global_batch_hash([by_data_rank[d] for d in sorted(by_data_rank)])
