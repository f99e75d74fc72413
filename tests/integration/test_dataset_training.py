"""Training on a prepared dataset: a run on dp2 resumed on tp2 and on pp2 sees exactly the batches
(per-step hashes of the global batch's token ids) of the uninterrupted run; a dataset that changed
after the checkpoint, or a model too small for the tokenizer, is refused before any rank starts;
the exported Hugging Face directory carries the tokenizer."""
import json
from dataclasses import replace
import sysconfig
from pathlib import Path

import fsspec
import pytest
from transformers import AutoTokenizer

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.actors.training.dataset_reader import PreparedDataset
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.cluster.cli.commands.train import config_from_args
from rayshard.cluster.cli.main import build_parser, main
from rayshard.cluster.data.documents import ReadOptions
from rayshard.cluster.data.prepare import prepare_dataset
from rayshard.cluster.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from rayshard.cluster.catalog.store import Store
from rayshard.plans.config import DataConfig, ModelChoice, OptimizerConfig
from rayshard.plans.data.errors import DatasetMismatch
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config

STDLIB = Path(sysconfig.get_paths()["stdlib"])
MODULES = ("textwrap.py", "bisect.py", "colorsys.py", "keyword.py", "heapq.py")


def _corpus(folder: Path, modules=MODULES) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    for name in modules:
        (folder / name).write_text((STDLIB / name).read_text()[:6000])
    return sorted(str(folder / name) for name in modules)  # the order a glob of the folder gives


@pytest.fixture(scope="module")
def dataset(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    inputs = _corpus(root / "text")
    save_tokenizer(train_tokenizer(inputs, 300), str(root / "tok"))
    tokenizer = load_tokenizer(str(root / "tok"))
    prepare_dataset(inputs, tokenizer, str(root / "ds"), cpus_per_task=0)
    return root, tokenizer


def _config(store: Path, url: str, layout, **overrides):
    optimizer = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=2, decay_steps=6)
    values = dict(model=ModelChoice.named("tiny", vocab_size=320), data=DataConfig(dataset=url), optimizer=optimizer, steps=6)
    values.update(overrides)
    return small_config(store, layout, **values)


def _hashes(store: Path, run: str) -> dict[int, str]:
    lines = (store / "store" / run / "metrics.jsonl").read_text().splitlines()
    return {record["step"]: record["batch_hash"] for record in map(json.loads, lines)}


@pytest.fixture(scope="module")
def uninterrupted(run_training, dataset, tmp_path_factory):
    root, _ = dataset
    store = tmp_path_factory.mktemp("dataset-runs")
    result = run_training(_config(store, str(root / "ds"), ParallelLayout(dp=2), run="ref", ckpt_every=3))
    return store, result


def test_resumes_on_tp2_and_pp2_see_the_uninterrupted_batches(run_training, dataset, uninterrupted):
    root, _ = dataset
    store, reference = uninterrupted
    expected = _hashes(store, "ref")
    assert sorted(expected) == list(range(1, 7)) and len(set(expected.values())) == 6 and all(expected.values())
    # tp2 names the dataset as `--data URL` does (data.source); pp2 as data.dataset.
    tp2 = run_training(_config(store, None, ParallelLayout(tp=2), run="tp2", resume="ref@3",
                               data=DataConfig(source=str(root / "ds"))))
    pp2 = run_training(_config(store, str(root / "ds"), ParallelLayout(pp=2), run="pp2", resume="ref@3"))
    for run, result in (("tp2", tp2), ("pp2", pp2)):
        hashes = _hashes(store, run)
        assert {step: hashes[step] for step in (4, 5, 6)} == {step: expected[step] for step in (4, 5, 6)}, run
        for step in (4, 5, 6):
            assert result.losses[step] == pytest.approx(reference.losses[step], rel=1e-4), (run, step)


def test_checkpoint_records_the_dataset_and_export_carries_the_tokenizer(dataset, uninterrupted, tmp_path, capsys):
    root, tokenizer = dataset
    store, reference = uninterrupted
    checkpoint = reference.checkpoints[-1]
    recorded = StoredCheckpoint(checkpoint).metadata["data_position"]["dataset"]
    assert recorded["url"] == str(root / "ds") and recorded["tokenizer_hash"] == tokenizer.hash
    export_hf(checkpoint, str(tmp_path / "hf"), log=lambda _: None)
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf.encode("def heappush(heap, item):", add_special_tokens=False) == tokenizer.tokenizer.encode("def heappush(heap, item):").ids
    # What `make demo` ends with: a line of text from the export through transformers alone.
    assert main(["ckpt", "generate", str(tmp_path / "hf"), "--prompt", "def heap", "--max-new-tokens", "6"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("def heap") and len(hf.encode(line, add_special_tokens=False)) > len(hf.encode("def heap"))
    imported = import_hf(str(tmp_path / "hf"), Store(str(tmp_path / "store")), "imported", log=lambda _: None)
    kept = StoredCheckpoint(imported).metadata["tokenizer_url"]
    assert load_tokenizer(kept).hash == tokenizer.hash  # `data prepare --tokenizer` can use it


def test_a_dataset_changed_after_the_checkpoint_is_refused(run_training, dataset, uninterrupted, tmp_path):
    root, tokenizer = dataset
    store, _ = uninterrupted
    other = _corpus(tmp_path / "other", MODULES[:3])
    prepare_dataset(other, tokenizer, str(tmp_path / "other-ds"), cpus_per_task=0)
    with pytest.raises(DatasetMismatch) as error:
        run_training(_config(store, str(tmp_path / "other-ds"), ParallelLayout(dp=2), run="changed", resume="ref@3"))
    message = str(error.value)
    assert "index hash" in message and str(tmp_path / "other-ds") in message and str(root / "ds") in message
    # Back to text after a prepared dataset: the data would change, too.
    with pytest.raises(DatasetMismatch, match="reads text"):
        run_training(_config(store, None, ParallelLayout(dp=2), run="text", resume="ref@3"))


def test_model_smaller_than_the_tokenizer_is_refused(run_training, dataset, tmp_path):
    root, _ = dataset
    with pytest.raises(ConfigError) as error:
        run_training(_config(tmp_path, str(root / "ds"), ParallelLayout(), model=ModelChoice.named("tiny")))
    assert "model.vocab_size=256" in str(error.value) and "(300)" in str(error.value)


def test_a_preset_with_data_takes_the_tokenizers_vocabulary_and_trains(run_training, dataset, tmp_path, capsys):
    """`rayshard train --data DATASET` with a preset and no vocabulary given: the model takes the
    tokenizer's, rounded up so that every tp the model allows divides it (tiny: 2 kv heads)."""
    root, tokenizer = dataset
    flags = ["train", "--data", str(root / "ds"), "--store", str(tmp_path / "store"), "--run", "v", "--steps", "2",
             "--global-batch", "2", "--seq-len", "16", "--dp", "1", "--tp", "2"]
    config = config_from_args(build_parser().parse_args(flags))
    expected = -(-tokenizer.vocab_size // 2) * 2
    assert config.model.spec.vocab_size == expected >= tokenizer.vocab_size > 256
    assert f"model.vocab_size={expected}: the tokenizer of {root / 'ds'} has {tokenizer.vocab_size} ids" in capsys.readouterr().err
    assert sorted(run_training(config).losses) == [1, 2]
    given = config_from_args(build_parser().parse_args(flags + ["--vocab-size", "256", "--run", "given"]))
    with pytest.raises(ConfigError, match=r"model.vocab_size=256: is smaller than the tokenizer's vocabulary"):
        run_training(given)  # a vocabulary given is kept, and refused before any rank starts


@pytest.mark.slow  # decision 153: the reader's store access is test_data_prepare's and the S3 training tests'
def test_training_reads_the_dataset_from_an_object_store(run_training, dataset, uninterrupted, object_store):
    """The same inputs prepared on the S3 test server (or Azurite) have the same identity, so the
    same batches."""
    s3_store = object_store.url
    root, tokenizer = dataset
    store, _ = uninterrupted
    fs, bucket_root = fsspec.core.url_to_fs(s3_store)
    for name in MODULES:
        fs.pipe_file(f"{bucket_root}/text/{name}", (root / "text" / name).read_bytes())
    summary = prepare_dataset([f"{s3_store}/text/*"], tokenizer, f"{s3_store}/ds", ReadOptions(), cpus_per_task=0)
    assert summary.index_hash == load_index_hash(root / "ds")
    config = replace(_config(store, f"{s3_store}/ds", ParallelLayout(dp=2), steps=2, run="s3"), store=s3_store)
    run_training(config)
    lines = fs.cat_file(f"{bucket_root}/s3/metrics.jsonl").decode().splitlines()
    hashes = {r["step"]: r["batch_hash"] for r in map(json.loads, lines)}
    assert hashes == {step: _hashes(store, "ref")[step] for step in (1, 2)}


def load_index_hash(url) -> str:
    return PreparedDataset(str(url), 32).meta.index_hash


def test_a_mixed_run_is_layout_independent_and_its_weights_are_recorded(run_training, dataset, uninterrupted, tmp_path):
    """--data a=0.7,b=0.3: dp2 resumed on tp2 logs the uninterrupted run's batch hashes; the
    checkpoint records both datasets and weights; a resume with other weights is refused."""
    root, tokenizer = dataset
    other = _corpus(tmp_path / "other", ("string.py", "fnmatch.py", "glob.py"))
    prepare_dataset(other, tokenizer, str(tmp_path / "other-ds"), cpus_per_task=0)
    mix = f"{root / 'ds'}=0.7,{tmp_path / 'other-ds'}=0.3"
    source = DataConfig(source=mix)  # what `--data a=0.7,b=0.3` sets
    reference = run_training(_config(tmp_path, None, ParallelLayout(dp=2), run="mix", steps=4, ckpt_every=2, data=source))
    recorded = StoredCheckpoint(reference.checkpoints[0]).metadata["data_position"]["dataset"]
    assert [(p["url"], p["weight"]) for p in recorded["mixture"]] == [(str(root / "ds"), 0.7), (str(tmp_path / "other-ds"), 0.3)]
    assert recorded["mixture"][1]["index_hash"] == load_index_hash(tmp_path / "other-ds") != recorded["mixture"][0]["index_hash"]
    run_training(_config(tmp_path, mix, ParallelLayout(tp=2), run="mix-tp2", steps=4, resume="mix@2"))
    expected, resumed = _hashes(tmp_path, "mix"), _hashes(tmp_path, "mix-tp2")
    assert {s: resumed[s] for s in (3, 4)} == {s: expected[s] for s in (3, 4)}
    assert expected[1] != _hashes(uninterrupted[0], "ref")[1]  # the mix is not the first dataset alone (same seed)
    reweighted = f"{root / 'ds'}=0.5,{tmp_path / 'other-ds'}=0.5"
    with pytest.raises(DatasetMismatch) as error:
        run_training(_config(tmp_path, reweighted, ParallelLayout(dp=2), run="mix-other", steps=4, resume="mix@2"))
    assert f"{root / 'ds'}=0.7" in str(error.value) and f"{root / 'ds'}=0.5" in str(error.value)

