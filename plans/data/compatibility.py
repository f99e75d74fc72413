"""Whether a model and a checkpoint can train on a prepared dataset: checked before any rank starts."""
from __future__ import annotations

from rayshard.plans.data.mixture import describe
from rayshard.plans.data.errors import DatasetMismatch
from rayshard.plans.errors import ConfigError


def check_vocab_fits(model_vocab_size: int, tokenizer_vocab_size: int, dataset_url: str) -> None:
    if model_vocab_size < tokenizer_vocab_size:
        raise ConfigError("model.vocab_size", model_vocab_size,
                          f"is smaller than the tokenizer's vocabulary ({tokenizer_vocab_size}) of dataset {dataset_url}",
                          f"pass --vocab-size {tokenizer_vocab_size} or more, or leave it out "
                          "(a preset then takes the tokenizer's), or prepare the data with a smaller tokenizer")


def check_same_dataset(recorded: dict, current: dict, checkpoint_url: str) -> None:
    """recorded: the checkpoint's data_position["dataset"]; current: this run's record of the same
    shape (one dataset's identity, or a mixture's: plans/data/mixture.py). A checkpoint that recorded
    none (byte-level text, or imported from Hugging Face) may start on any dataset: that is
    fine-tuning, not a resume of the same data."""
    if recorded.get("tokenizer_hash") != current.get("tokenizer_hash"):
        raise DatasetMismatch(
            f"dataset {current.get('url')} has tokenizer hash {current.get('tokenizer_hash')}, but {checkpoint_url} was "
            f"trained on {recorded.get('url')} with tokenizer hash {recorded.get('tokenizer_hash')}; the data changed "
            "after the checkpoint. Fix: resume with the dataset the checkpoint recorded, or start a new --run")
    if recorded.get("index_hash") != current.get("index_hash"):
        if "mixture" in recorded or "mixture" in current:
            raise DatasetMismatch(
                f"this run reads {describe(current)}, but {checkpoint_url} was trained on {describe(recorded)}; "
                "different datasets or weights change the sample order. Fix: resume with the checkpoint's "
                f"--data {recorded.get('url')}, or start a new --run")
        raise DatasetMismatch(
            f"dataset {current.get('url')} has index hash {current.get('index_hash')}, but {checkpoint_url} was trained on "
            f"{recorded.get('url')} with index hash {recorded.get('index_hash')}; the data changed after the checkpoint. "
            "Fix: resume with the dataset the checkpoint recorded, or start a new --run")
