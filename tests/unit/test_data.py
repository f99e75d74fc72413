import torch

from rayshard.actors.training.data import corpus_fingerprint, global_batch, load_corpus, rank_batch


def test_default_corpus_is_available_offline_and_deterministic():
    first = load_corpus("stdlib", 200_000)
    assert first.numel() == 200_000 and first.dtype == torch.uint8
    assert corpus_fingerprint(first) == corpus_fingerprint(load_corpus("stdlib", 200_000))


def test_sample_order_depends_only_on_seed_and_step_not_on_layout():
    corpus = torch.arange(10_000, dtype=torch.int64).remainder(251).to(torch.uint8)
    inputs, targets = global_batch(corpus, seed=5, step=3, batch=8, seq_len=16)
    torch.testing.assert_close(targets[:, :-1], inputs[:, 1:])
    for data_ranks in (1, 2, 4, 8):
        pieces = [rank_batch(corpus, 5, 3, 8, 16, r, data_ranks)[0] for r in range(data_ranks)]
        torch.testing.assert_close(torch.cat(pieces), inputs)
    assert not torch.equal(global_batch(corpus, 5, 4, 8, 16)[0], inputs)
    assert not torch.equal(global_batch(corpus, 6, 3, 8, 16)[0], inputs)


def test_corpus_from_files_and_fsspec_url(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"world")
    (tmp_path / "a.txt").write_bytes(b"hello ")
    assert bytes(load_corpus(str(tmp_path), 100).numpy()) == b"hello world"
    assert bytes(load_corpus(f"file://{tmp_path}/a.txt", 100).numpy()) == b"hello "
    assert bytes(load_corpus(str(tmp_path / "*.txt"), 8).numpy()) == b"hello wo"
