"""Several prepared datasets mixed with weights (`--data a=0.7,b=0.3`): which dataset, and which of
its samples, each row of a global batch takes, as a pure function of (seed, step, the datasets'
sample counts, the weights).

Global row positions are cut into blocks of MIX_BLOCK. Every block gives each dataset the same
whole number of slots (the weights rounded by largest remainder, so the realised mix is the
weights to within 1/MIX_BLOCK), in an order a keyed permutation of the block shuffles. A row's
position within its dataset is then closed-form (blocks before it x the dataset's slots, plus its
slot's rank), so no rank counts earlier steps, and each dataset is read in its own permuted
epochs exactly as a dataset alone is (plans/data/sample_order.py). Nothing depends on the layout.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np

from rayshard.plans.data.sample_order import permuted
from rayshard.plans.errors import ConfigError

MIX_BLOCK = 1024
_ITEM = re.compile(r"^(?P<url>.+)=(?P<weight>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")


@dataclass(frozen=True)
class Mixture:
    urls: tuple[str, ...]
    weights: tuple[float, ...]  # as given; normalised where used

    def text(self) -> str:
        return ",".join(f"{url}={weight:g}" for url, weight in zip(self.urls, self.weights))


def is_mixture(text: str | None) -> bool:
    """Whether a --data value names weighted datasets (every comma-separated item ends in =NUMBER)."""
    return bool(text) and all(_ITEM.match(item.strip()) for item in text.split(","))


def parse_mixture(text: str, field: str = "data.dataset") -> Mixture:
    urls, weights = [], []
    for item in text.split(","):
        match = _ITEM.match(item.strip())
        if match is None:
            raise ConfigError(field, text, f"item {item!r} is not URL=WEIGHT", "write it as a=0.7,b=0.3")
        urls.append(match["url"].rstrip("/"))
        weights.append(float(match["weight"]))
    if len(set(urls)) != len(urls):
        raise ConfigError(field, text, "names a dataset twice", "give each dataset once, with its total weight")
    if any(w <= 0 for w in weights):
        raise ConfigError(field, text, "has a weight that is not positive", "leave the dataset out instead")
    if any(count == 0 for count in block_counts(tuple(weights))):
        raise ConfigError(field, text, f"has a weight below 1/{MIX_BLOCK} of the total, which would never be read",
                          "raise it or leave the dataset out")
    return Mixture(tuple(urls), tuple(weights))


def block_counts(weights: tuple[float, ...], block: int = MIX_BLOCK) -> np.ndarray:
    """Slots per block for each dataset: block x normalised weight, rounded by largest remainder."""
    share = np.asarray(weights, dtype=np.float64) / float(sum(weights)) * block
    counts = np.floor(share).astype(np.int64)
    remainders = share - counts
    for index in np.argsort(-remainders, kind="stable")[:block - int(counts.sum())]:
        counts[index] += 1
    return counts


def _key(seed: int, what: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"mix:{what}:{seed}".encode(), digest_size=8).digest(), "little") >> 1


def mixed_batch_ids(seed: int, step: int, batch: int, sample_counts: tuple[int, ...],
                    weights: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(dataset index, sample id within that dataset) of each row of global batch `step`."""
    counts = block_counts(weights)
    ends = np.cumsum(counts)
    positions = np.arange(step * batch, (step + 1) * batch, dtype=np.int64)
    blocks, offsets = np.divmod(positions, MIX_BLOCK)
    slots = np.empty(batch, dtype=np.int64)
    for block in np.unique(blocks):
        chosen = blocks == block
        slots[chosen] = permuted(offsets[chosen], MIX_BLOCK, _key(seed, "slots"), int(block))
    datasets = np.searchsorted(ends, slots, side="right")
    within = blocks * counts[datasets] + (slots - (ends - counts)[datasets])
    samples = np.empty(batch, dtype=np.int64)
    for dataset in np.unique(datasets):
        chosen = datasets == dataset
        count = int(sample_counts[dataset])
        epochs, inside = np.divmod(within[chosen], count)
        ids = np.empty(inside.shape, dtype=np.int64)
        for epoch in np.unique(epochs):
            at = epochs == epoch
            ids[at] = permuted(inside[at], count, _key(seed, f"dataset{dataset}"), int(epoch))
        samples[chosen] = ids
    return datasets, samples


def mixture_record(mixture: Mixture, identities: list) -> dict:
    """What a checkpoint records of a mixture: every dataset's identity and weight, plus one index
    hash over them all (so a resume compares it as it compares a single dataset's)."""
    parts = [dict(identity.to_dict(), weight=weight) for identity, weight in zip(identities, mixture.weights)]
    digest = hashlib.sha256("|".join(f"{p['index_hash']}={p['weight']!r}" for p in parts).encode()).hexdigest()[:32]
    first = identities[0]
    return {"url": mixture.text(), "index_hash": digest, "tokenizer_hash": first.tokenizer_hash,
            "tokenizer_url": first.tokenizer_url, "mixture": parts}


def describe(record: dict) -> str:
    """A dataset record in a few words: its URL, or each mixed dataset's URL, weight and hash."""
    if "mixture" in record:
        return "mix of " + ", ".join(f"{p['url']}={p['weight']:g} (index hash {p['index_hash']})" for p in record["mixture"])
    return f"{record.get('url')} (index hash {record.get('index_hash')})"
