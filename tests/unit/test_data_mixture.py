"""Weighted mixtures of prepared datasets (plans/data/mixture.py): parsing, the realised mix, and
each dataset still read in whole permuted epochs."""
import numpy as np
import pytest

from rayshard.plans.data.compatibility import check_same_dataset
from rayshard.plans.data.dataset_index import DatasetIdentity
from rayshard.plans.data.errors import DatasetMismatch
from rayshard.plans.data.mixture import MIX_BLOCK, block_counts, is_mixture, mixed_batch_ids, mixture_record, parse_mixture
from rayshard.plans.errors import ConfigError


def test_parse_and_recognise():
    mixture = parse_mixture("s3://b/code=0.7, runs/prose/=0.3")
    assert mixture.urls == ("s3://b/code", "runs/prose") and mixture.weights == (0.7, 0.3)
    assert is_mixture("a=0.7,b=0.3") and is_mixture("a=2") and not is_mixture("runs/ds") and not is_mixture("a=x,b=1")
    for bad, words in (("a=0.5,a=0.5", "twice"), ("a=0,b=1", "not positive"), ("a=1,b=0.0001", "never be read")):
        with pytest.raises(ConfigError, match=words):
            parse_mixture(bad)


def test_block_counts_round_by_largest_remainder():
    assert block_counts((0.7, 0.3)).tolist() == [717, 307]  # 716.8 and 307.2: the larger remainder gets the slot
    assert block_counts((1, 1, 1)).sum() == MIX_BLOCK and sorted(block_counts((1, 1, 1)).tolist()) == [341, 341, 342]


def test_realised_mix_over_many_steps_is_the_weights():
    counts, weights, batch = (50, 200, 7), (0.5, 0.3, 0.2), 24
    datasets = np.concatenate([mixed_batch_ids(11, step, batch, counts, weights)[0] for step in range(400)])
    realised = np.bincount(datasets, minlength=3) / len(datasets)
    assert np.abs(realised - np.asarray(weights)).max() < 2e-3, realised  # 9,600 rows: within 1/MIX_BLOCK


def test_each_dataset_is_read_in_whole_epochs_and_order_is_pure():
    counts, weights, batch = (37, 90), (0.25, 0.75), 16
    steps = [mixed_batch_ids(5, step, batch, counts, weights) for step in range(2 * MIX_BLOCK // batch)]
    datasets = np.concatenate([d for d, _ in steps])
    samples = np.concatenate([s for _, s in steps])
    assert np.bincount(datasets).tolist() == (2 * block_counts(weights)).tolist()  # exact over whole blocks
    for dataset, count in enumerate(counts):
        # A dataset's rows are its positions 0, 1, 2, ... (shuffled within a block): whole permuted
        # epochs, so no sample is read twice before every other one has been read once.
        times = np.bincount(samples[datasets == dataset], minlength=count)
        assert times.max() - times.min() <= 1, (dataset, times)
    again = mixed_batch_ids(5, 3, batch, counts, weights)
    assert all(np.array_equal(a, b) for a, b in zip(again, steps[3]))
    other = mixed_batch_ids(6, 3, batch, counts, weights)
    assert not all(np.array_equal(a, b) for a, b in zip(other, steps[3]))


def test_resume_with_other_weights_is_refused_naming_them():
    ids = [DatasetIdentity("runs/a", "aaaa", "tok", "runs/a/t"), DatasetIdentity("runs/b", "bbbb", "tok", "runs/b/t")]
    recorded = mixture_record(parse_mixture("runs/a=0.7,runs/b=0.3"), ids)
    check_same_dataset(recorded, mixture_record(parse_mixture("runs/a=0.7,runs/b=0.3"), ids), "ckpt")
    with pytest.raises(DatasetMismatch) as error:
        check_same_dataset(recorded, mixture_record(parse_mixture("runs/a=0.5,runs/b=0.5"), ids), "ckpt")
    assert "runs/a=0.7 (index hash aaaa)" in str(error.value) and "runs/a=0.5" in str(error.value)
    with pytest.raises(DatasetMismatch, match="runs/a .index hash aaaa"):  # a mixture resumed on one of its parts
        check_same_dataset(recorded, ids[0].to_dict(), "ckpt")
