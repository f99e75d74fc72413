"""Where a rank's batches come from: byte-level text (the default) or a prepared dataset.

Both answer the same question — this data rank's rows of global batch `step` — as a pure function
of (seed, step, the data), so the data position is the step on every layout.
"""
from __future__ import annotations

import torch

from rayshard.actors.training.data import corpus_fingerprint, load_corpus, rank_batch
from rayshard.actors.training.data_prefetch import StepPrefetcher
from rayshard.actors.training.dataset_reader import PreparedDataset, holds_prepared_dataset
from rayshard.actors.training.mixed_dataset import MixedDataset
from rayshard.plans.config import TrainConfig
from rayshard.plans.data.compatibility import check_vocab_fits
from rayshard.plans.data.mixture import is_mixture, parse_mixture
from rayshard.plans.errors import ConfigError
from rayshard.actors.training.completion_loss import IGNORE


def prepared_dataset_url(config: TrainConfig) -> str | None:
    """data.dataset, or data.source when it holds a prepared dataset (`--data URL`) or names weighted
    ones (`--data a=0.7,b=0.3`); None for text."""
    if config.data.dataset:
        return config.data.dataset
    source = config.data.source
    return source if is_mixture(source) or holds_prepared_dataset(source) else None


def open_prepared(url: str, seq_len: int, objective: str = "lm") -> PreparedDataset | MixedDataset:
    """One dataset, or a weighted mixture of several (plans/data/mixture.py). objective sft: one
    example per sample, with loss masks (an SFT dataset); dpo: one preference pair per sample; a
    mixture of either is not supported yet."""
    if is_mixture(url):
        if objective != "lm":
            raise ConfigError("objective", objective, f"a mixture of datasets ({url}) is not supported with {objective} yet",
                              "prepare the examples into one dataset, or train with --objective lm")
        return MixedDataset(parse_mixture(url), seq_len)
    return PreparedDataset(url, seq_len, sft=objective == "sft", preference=objective == "dpo")


class ByteText:
    """Byte-level tokens of text files: vocabulary 256, random windows per step."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.corpus = load_corpus(config.data.source, config.data.max_bytes)

    def rank_batch(self, step: int, data_rank: int, data_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return rank_batch(self.corpus, c.seed, step, c.global_batch, c.seq_len, data_rank, data_ranks)

    def fingerprint(self) -> str:
        return corpus_fingerprint(self.corpus)


class DatasetBatches:
    """Packed samples of a prepared dataset, this data rank's rows prefetched a few steps ahead.

    The index is read at the first batch, not at setup: the driver hands the ranks its object-store
    options (endpoint, retries) only after they are set up."""

    def __init__(self, config: TrainConfig, url: str, data_rank: int, data_ranks: int):
        self.config, self.url = config, url
        self.data_rank, self.data_ranks = data_rank, data_ranks
        self.dataset: PreparedDataset | MixedDataset | None = None
        self.prefetcher: StepPrefetcher | None = None
        # step -> the global batch's completion targets (--objective sft) or its pairs (dpo)
        self.loss_tokens: dict[int, int] = {}
        self.reference_logps: dict[int, torch.Tensor] = {}  # --dpo-precomputed: step -> this rank's rows'
        self.tokens: dict[int, int] = {}  # sft, dpo: step -> this rank's rows' tokens, padding left out

    def _open(self) -> StepPrefetcher:
        config = self.config
        self.dataset = open_prepared(self.url, config.seq_len, config.objective)
        check_vocab_fits(config.model.spec.vocab_size, self.dataset.meta.vocab_size, self.url)
        if config.objective == "dpo" and config.dpo.precomputed:
            self.dataset.read_reference_logprobs(config.dpo.logprobs_file)
        dataset, data_rank, data_ranks = self.dataset, self.data_rank, self.data_ranks
        read = {"sft": "rank_examples", "dpo": "rank_pairs"}.get(config.objective, "rank_windows")
        read = getattr(dataset, read)
        return StepPrefetcher(lambda step: read(config.seed, step, config.global_batch, data_rank, data_ranks),
                              config.data.prefetch_steps, config.data.read_timeout_s, self.url)

    def rank_batch(self, step: int, data_rank: int, data_ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets); under --objective sft or dpo a target the loss skips (prompt, padding) is
        IGNORE (under dpo the rows are pairs: chosen, rejected, chosen, ...)."""
        assert (data_rank, data_ranks) == (self.data_rank, self.data_ranks), "a rank's data slice is fixed at setup"
        if self.prefetcher is None:
            self.prefetcher = self._open()
        fetched = self.prefetcher.get(step)
        if self.config.objective == "lm":
            return fetched[:, :-1], fetched[:, 1:]
        self.loss_tokens[step], self.tokens[step] = fetched.global_count, fetched.tokens
        if fetched.reference_logps is not None:
            self.reference_logps[step] = fetched.reference_logps
        windows, masks = fetched.windows, fetched.masks
        return windows[:, :-1], windows[:, 1:].masked_fill(~masks[:, 1:], IGNORE)

    def global_loss_tokens(self, step: int) -> int:
        """--objective sft: the completion targets of global batch `step` (after its rank_batch); dpo: its pairs."""
        return self.loss_tokens.pop(step)

    def rank_tokens(self, step: int) -> int | None:
        """--objective sft or dpo: the tokens of this rank's rows of step (after its rank_batch),
        padding left out; None where every position is a token (packed windows)."""
        return self.tokens.pop(step, None)

    def fingerprint(self) -> str:
        # The dataset's identity (index and tokenizer hashes) is what checkpoints record and resumes
        # compare; the driver reads it (cluster/data/training_data.py).
        return f"dataset:{self.url}"


def open_training_data(config: TrainConfig, data_rank: int, data_ranks: int) -> ByteText | DatasetBatches:
    url = prepared_dataset_url(config)
    return ByteText(config) if url is None else DatasetBatches(config, url, data_rank, data_ranks)
