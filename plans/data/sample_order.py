"""Which packed samples make up global batch `step`: a pure function of (seed, step, sample count).

Every rank computes the same ids and takes its own rows, so the data position is the step alone and
survives any change of layout. Epochs are random permutations of all samples; a keyed Feistel
network walks the permutation index by index, so no rank ever materialises it (a billion-sample
dataset costs what a ten-sample one does).
"""
from __future__ import annotations

import hashlib

import numpy as np

_ROUNDS = 4
_MASK64 = (1 << 64) - 1


def _round_keys(seed: int, epoch: int) -> list[int]:
    digest = hashlib.blake2b(f"samples:{seed}:{epoch}".encode(), digest_size=8 * _ROUNDS).digest()
    return [int.from_bytes(digest[8 * i:8 * i + 8], "little") for i in range(_ROUNDS)]


def _mix(values: np.ndarray, key: int) -> np.ndarray:
    # splitmix64's finaliser: cheap, and every input bit reaches every output bit.
    with np.errstate(over="ignore"):
        z = (values + np.uint64(key)) & np.uint64(_MASK64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def permuted(positions: np.ndarray, count: int, seed: int, epoch: int) -> np.ndarray:
    """The images of `positions` (each in [0, count)) under the epoch's permutation of range(count)."""
    half_bits = max(1, (max(count - 1, 1).bit_length() + 1) // 2)
    half_mask = np.uint64((1 << half_bits) - 1)
    keys = _round_keys(seed, epoch)
    values = positions.astype(np.uint64)
    todo = np.ones(values.shape, dtype=bool)
    # Cycle walking: the network permutes [0, 4**half_bits); values that land past `count` are
    # permuted again until they fall inside (fewer than four passes on average).
    while todo.any():
        left, right = values[todo] >> np.uint64(half_bits), values[todo] & half_mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & half_mask)
        values[todo] = (left << np.uint64(half_bits)) | right
        todo = values >= np.uint64(count)
    return values.astype(np.int64)


def batch_sample_ids(seed: int, step: int, batch: int, sample_count: int) -> np.ndarray:
    """The sample ids of global batch `step`: positions [step*batch, (step+1)*batch) of the
    endless sequence epoch 0, epoch 1, ..., each epoch its own permutation of all samples."""
    if sample_count < 1:
        raise ValueError("a dataset with no samples has no batches")
    positions = np.arange(step * batch, (step + 1) * batch, dtype=np.int64)
    epochs, within = np.divmod(positions, sample_count)
    ids = np.empty(batch, dtype=np.int64)
    for epoch in np.unique(epochs):
        chosen = epochs == epoch
        ids[chosen] = permuted(within[chosen], sample_count, seed, int(epoch))
    return ids
