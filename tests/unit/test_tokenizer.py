"""Tokenizers: a byte-level BPE trained on local text, saved for transformers, loaded back; the
vocabulary check a model must pass before training on the tokenizer's data."""
import json

import pytest

from rayshard.cluster.data.documents import ReadOptions
from rayshard.cluster.data.tokenizer import (END_OF_DOCUMENT, load_tokenizer, save_tokenizer, tokenizer_url_of,
                                    train_tokenizer)
from rayshard.plans.data.compatibility import check_vocab_fits
from rayshard.plans.errors import ConfigError, RayshardError

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 20 + "naïve café ünïcode ✓\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    (folder / "a.py").write_text(TEXT)
    (folder / "b.jsonl").write_text(json.dumps({"body": "json text, with é"}) + "\n")
    loaded = train_tokenizer([str(folder / "a.py"), str(folder / "b.jsonl")], 300, ReadOptions(field="body"))
    save_tokenizer(loaded, str(folder / "out"))
    return folder, loaded


def test_trained_bpe_round_trips_text_and_learned_merges(trained):
    _, loaded = trained
    assert loaded.eos_token == END_OF_DOCUMENT and loaded.eos_id == 0
    assert 257 < loaded.vocab_size <= 300  # bytes, the end-of-document token and some merges
    ids = loaded.tokenizer.encode(TEXT).ids
    assert len(ids) < len(TEXT.encode()) / 2  # merges compress the repeated code
    assert loaded.tokenizer.decode(ids) == TEXT


def test_saved_tokenizer_loads_from_directory_file_and_transformers(trained):
    folder, loaded = trained
    for path in (str(folder / "out"), str(folder / "out" / "tokenizer.json"), f"file://{folder}/out"):
        again = load_tokenizer(path)
        assert again.hash == loaded.hash and again.eos_id == loaded.eos_id
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder / "out"))
    assert hf.encode(TEXT, add_special_tokens=False) == loaded.tokenizer.encode(TEXT).ids
    assert hf.eos_token == END_OF_DOCUMENT


def test_hugging_face_directory_names_its_own_eos(tmp_path, trained):
    folder, loaded = trained
    (tmp_path / "tokenizer.json").write_text(loaded.json_text)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": END_OF_DOCUMENT}}))
    assert load_tokenizer(str(tmp_path)).eos_id == loaded.eos_id


def test_bad_tokenizer_paths_and_sizes_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="no tokenizer.json there"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="at least 257"):
        train_tokenizer([str(tmp_path / "tokenizer.json")], 100)


@pytest.mark.parametrize("config, says", [('{"eos_token": "</s>",', "is not valid JSON"), ('["</s>"]', "holds a JSON list"),
                                           ('{"eos_token": ["</s>"]}', None)])
def test_a_damaged_tokenizer_config_is_a_one_line_error(tmp_path, trained, config, says):
    """A tokenizer_config.json that is no JSON object is named (it raised json's error, which every
    Hugging Face export of the run then hit); an eos_token that is no name is passed over."""
    _, loaded = trained
    (tmp_path / "tokenizer.json").write_text(loaded.json_text)
    (tmp_path / "tokenizer_config.json").write_text(config)
    if says is None:
        assert load_tokenizer(str(tmp_path)).eos_id == loaded.eos_id
        return
    with pytest.raises(ConfigError, match=says) as refused:
        load_tokenizer(str(tmp_path))
    assert "\n" not in str(refused.value)


def test_tokenizer_without_end_of_document_token_is_refused(tmp_path, trained):
    _, loaded = trained
    document = json.loads(loaded.json_text)
    document["added_tokens"] = []
    document["model"]["vocab"].pop(END_OF_DOCUMENT)
    (tmp_path / "tokenizer.json").write_text(json.dumps(document))
    with pytest.raises(RayshardError, match="no end-of-document token"):
        load_tokenizer(str(tmp_path))


def test_model_vocabulary_must_hold_the_tokenizers():
    check_vocab_fits(320, 300, "s3://b/ds")
    check_vocab_fits(300, 300, "s3://b/ds")
    with pytest.raises(ConfigError) as error:
        check_vocab_fits(256, 300, "s3://b/ds")
    message = str(error.value)
    assert "256" in message and "300" in message and "\n" not in message


def test_tokenizer_url_of_checkpoint_metadata():
    assert tokenizer_url_of({"data_position": {"dataset": {"tokenizer_url": "s3://b/ds/t"}}}) == "s3://b/ds/t"
    assert tokenizer_url_of({"tokenizer_url": "runs/r/tokenizer", "data_position": {"dataset": None}}) == "runs/r/tokenizer"
    assert tokenizer_url_of({"data_position": {"corpus": "x"}}) is None
