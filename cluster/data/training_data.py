"""The driver's side of training on a prepared dataset (or a weighted mixture of several): the
vocabulary a preset takes from it, checks before any rank starts, what a checkpoint records of the
data, and one hash per step of the global batch.
"""
from __future__ import annotations

from dataclasses import replace

from rayshard.actors.training.dataset_reader import PreparedDataset
from rayshard.actors.training.dataset_source import open_prepared, prepared_dataset_url
from rayshard.actors.training.mixed_dataset import MixedDataset
from rayshard.actors.training.reports import StepMetrics
from rayshard.plans.config import TrainConfig
from rayshard.plans.data.batch_hash import global_batch_hash
from rayshard.plans.data.compatibility import check_same_dataset, check_vocab_fits
from rayshard.plans.data.errors import DatasetMismatch
from rayshard.plans.errors import ConfigError
from rayshard.plans.data.mixture import mixture_record
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.tp_fit import vocab_multiple

# (dataset URL or mixture, seq_len) -> what checkpoints record: read from the index(es) when a run
# starts (check_training_data), then reused by every save instead of re-reading the index.
_records: dict[tuple[str, int], dict] = {}


def _record_of(dataset: PreparedDataset | MixedDataset) -> dict:
    if isinstance(dataset, MixedDataset):
        return mixture_record(dataset.mixture, dataset.identities())
    return dataset.identity().to_dict()


def check_training_data(config: TrainConfig, resumed_metadata: dict | None, checkpoint_url: str | None) -> None:
    """Refuse a model too small for the tokenizer, and a resume whose data is not the checkpoint's."""
    url = prepared_dataset_url(config)
    recorded = ((resumed_metadata or {}).get("data_position") or {}).get("dataset")
    if url is None:
        if config.objective != "lm":
            kind = {"sft": "sft", "dpo": "preference"}[config.objective]
            raise ConfigError("objective", config.objective, f"data {config.data.source!r} is text, not a prepared "
                              f"{'SFT' if kind == 'sft' else 'preference'} dataset",
                              f"pass --data the --out of `rayshard data prepare --format {kind}`, or --objective lm")
        if recorded is not None:  # trained on a prepared dataset, resumed on text: the data would change
            raise DatasetMismatch(
                f"{checkpoint_url} was trained on dataset {recorded.get('url')} (index hash {recorded.get('index_hash')}), "
                f"but this run reads text from {config.data.source!r}. Fix: pass --data {recorded.get('url')}, or start a new --run")
        return
    dataset = open_prepared(url, config.seq_len, config.objective)
    check_vocab_fits(config.model.spec.vocab_size, dataset.meta.vocab_size, url)
    record = _records[(url, config.seq_len)] = _record_of(dataset)
    if recorded is not None:
        check_same_dataset(recorded, record, checkpoint_url)


def with_dataset_vocabulary(config: TrainConfig, note=None) -> TrainConfig:
    """A built-in model whose vocabulary nobody set (no model.vocab_size in the file, no
    --vocab-size) trained on a prepared dataset takes its tokenizer's vocabulary, rounded up to a
    multiple of what the model's tp splits share, so every tp it allows cuts the vocabulary into
    equal shards (any vocabulary runs on any tp, decision 118; the extra rows are ids no sample holds). note: told the size chosen, in one line."""
    url = prepared_dataset_url(config)
    model = config.model
    if url is None or model.vocab_size is not None or model.spec.user is not None:
        return config
    tokenizer_vocab = open_prepared(url, config.seq_len).meta.vocab_size
    multiple = vocab_multiple(model.spec)
    rounded = -(-tokenizer_vocab // multiple) * multiple
    if rounded == model.spec.vocab_size:
        return config
    if note is not None:
        rounding = f", rounded up to a multiple of {multiple} so that tp splits it evenly" if rounded != tokenizer_vocab else ""
        note(f"model.vocab_size={rounded}: the tokenizer of {url} has {tokenizer_vocab} ids{rounding} "
             "(--vocab-size N sets another)")
    return replace(config, model=replace(model, spec=replace(model.spec, vocab_size=rounded)))


def with_resolved_dataset(config: TrainConfig) -> TrainConfig:
    """data.dataset set when data.source names a prepared dataset (`--data URL`) or a mixture: the
    driver decides text or dataset once, with its storage configured; ranks look no further."""
    url = prepared_dataset_url(config)
    if url is None or config.data.dataset:
        return config
    return replace(config, data=replace(config.data, dataset=url))


def dataset_record(config: TrainConfig) -> dict | None:
    """What checkpoint metadata's data_position records of a prepared dataset (None: text)."""
    url = prepared_dataset_url(config)
    if url is None:
        return None
    key = (url, config.seq_len)
    if key not in _records:
        _records[key] = _record_of(open_prepared(url, config.seq_len, config.objective))
    return _records[key]


def step_batch_hash(per_rank: list[StepMetrics], layout: ParallelLayout) -> str:
    """The global batch's hash from the ranks' row digests: one rank per data rank, in data-rank order
    (tp and pipeline peers hold the same rows)."""
    by_data_rank: dict[int, str] = {}
    for rank, metrics in enumerate(per_rank):
        by_data_rank.setdefault(layout.data_rank_of(rank), metrics.batch_hash)
    return global_batch_hash([by_data_rank[d] for d in sorted(by_data_rank)])
