"""Whether a model and a checkpoint can train on a prepared dataset: checked before any rank starts."""
from __future__ import annotations

from plans.data.dataset_index import DatasetIdentity
from plans.data.errors import DatasetMismatch
from plans.errors import ConfigError


def check_vocab_fits(model_vocab_size: int, tokenizer_vocab_size: int, dataset_url: str) -> None:
    if model_vocab_size < tokenizer_vocab_size:
        raise ConfigError("model.vocab_size", model_vocab_size,
                          f"is smaller than the tokenizer's vocabulary ({tokenizer_vocab_size}) of dataset {dataset_url}",
                          f"set model.vocab_size to {tokenizer_vocab_size} or more (a multiple of tp), "
                          "or prepare the data with a smaller tokenizer")


def check_same_dataset(recorded: dict, current: DatasetIdentity, checkpoint_url: str) -> None:
    """recorded: the checkpoint's data_position["dataset"]. A checkpoint that recorded none (byte-level
    text, or imported from Hugging Face) may start on any dataset: that is fine-tuning, not a resume
    of the same data."""
    for field, name in (("index_hash", "index hash"), ("tokenizer_hash", "tokenizer hash")):
        if recorded.get(field) != getattr(current, field):
            raise DatasetMismatch(
                f"dataset {current.url} has {name} {getattr(current, field)}, but {checkpoint_url} was trained on "
                f"{recorded.get('url')} with {name} {recorded.get(field)}; the data changed after the checkpoint. "
                "Fix: resume with the dataset the checkpoint recorded, or start a new --run")
