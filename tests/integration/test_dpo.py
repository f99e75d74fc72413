"""Direct Preference Optimization (`data prepare --format preference`, `--objective dpo`): prompt,
chosen and rejected rows become pairs of adjacent examples with loss masks on the responses; a
step draws whole pairs, never split across data ranks or microbatches; bad rows are refused in one
line naming the file and row."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rayshard.actors.training.dataset_reader import PreparedDataset
from rayshard.cluster.cli.main import main
from rayshard.cluster.data.documents import ReadOptions
from rayshard.cluster.data.prepare import prepare_dataset
from rayshard.cluster.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer
from rayshard.plans.data.sample_order import batch_sample_ids
from rayshard.plans.errors import ConfigError

PREFERENCE = ReadOptions(format="preference")
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def _rows(count: int, seed: int) -> list[dict]:
    """Asymmetric pairs: chosen and rejected of different lengths and words."""
    rng = np.random.default_rng(seed)
    words = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    return [{"prompt": f"{words(int(rng.integers(2, 8)))}:", "chosen": " " + words(int(rng.integers(1, 7))),
             "rejected": " " + words(int(rng.integers(1, 5)))} for _ in range(count)]


@pytest.fixture(scope="module")
def preference_data(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    (root / "text.txt").write_text(" ".join(WORDS * 20) + " <|im_start|> <|im_end|>")
    tokenizer = train_tokenizer([str(root / "text.txt")], 300)
    tokenizer = replace(tokenizer, config_json=json.dumps({"eos_token": tokenizer.eos_token, "chat_template": TEMPLATE}))
    save_tokenizer(tokenizer, str(root / "tok"))
    tokenizer = load_tokenizer(str(root / "tok"))
    rows = _rows(24, 0)
    (root / "in").mkdir()
    (root / "in" / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:12]) + "\n")
    pq.write_table(pa.Table.from_pylist(rows[12:]), root / "in" / "b.parquet")
    prepare_dataset([str(root / "in")], tokenizer, str(root / "ds"), PREFERENCE, cpus_per_task=0, log=lambda *_: None)
    return root, tokenizer, rows


def test_pairs_become_adjacent_examples_with_masks_on_the_responses(preference_data):
    root, tokenizer, rows = preference_data
    reader = PreparedDataset(str(root / "ds"), 40, preference=True)
    assert reader.samples == len(rows) and reader.meta.kind == "preference" and reader.meta.documents == 2 * len(rows)
    windows, masks = reader.read_examples(np.arange(2 * len(rows)))
    encode = lambda text: tokenizer.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    for index, row in enumerate(rows):
        prompt = encode(row["prompt"])
        for offset, field in ((0, "chosen"), (1, "rejected")):
            response = encode(row[field]) + [tokenizer.eos_id]
            length = len(prompt) + len(response)
            window, mask = windows[2 * index + offset], masks[2 * index + offset]
            assert window[:length].tolist() == prompt + response, (index, field)
            assert mask.tolist() == [False] * len(prompt) + [True] * len(response) + [False] * (41 - length)
    assert any(len(encode(r["chosen"])) != len(encode(r["rejected"])) for r in rows)  # asymmetric
    # A step's pairs are a pure function of (seed, step); each data rank gets whole pairs, chosen then rejected.
    ids = batch_sample_ids(7, 3, 4, reader.samples)
    for data_rank in range(2):
        got, got_masks, pairs = reader.rank_pairs(7, 3, 8, data_rank, 2)
        assert pairs == 4 and got.shape == (4, 41)
        mine = ids[2 * data_rank:2 * data_rank + 2]
        expected = windows[np.stack([2 * mine, 2 * mine + 1], 1).reshape(-1)]
        assert (got.numpy() == expected).all()
    # The same examples prepared as SFT hash differently: a preference dataset is not an SFT one.
    with pytest.raises(ConfigError, match="holds preference pairs, not SFT examples"):
        PreparedDataset(str(root / "ds"), 40, sft=True)


def test_a_messages_prompt_is_rendered_with_the_chat_template(preference_data, tmp_path):
    root, tokenizer, _ = preference_data
    messages = [{"role": "user", "content": "alpha beta?"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": messages, "chosen": "gamma", "rejected": "delta zeta"}) + "\n")
    prepare_dataset([str(tmp_path / "chat.jsonl")], tokenizer, str(tmp_path / "ds"), PREFERENCE, cpus_per_task=0,
                    log=lambda *_: None)
    windows, masks = PreparedDataset(str(tmp_path / "ds"), 100, preference=True).read_examples(np.arange(2))
    decode = lambda ids: tokenizer.tokenizer.decode(ids.tolist(), skip_special_tokens=False)  # noqa: E731
    prompt = "<|im_start|>user\nalpha beta?<|im_end|>\n<|im_start|>assistant\n"
    assert decode(windows[0][~masks[0]]).startswith(prompt) and decode(windows[0][masks[0]]) == "gamma" + tokenizer.eos_token
    assert decode(windows[1][masks[1]]) == "delta zeta" + tokenizer.eos_token


def test_bad_rows_are_named_in_one_line_and_counted_when_skipped(preference_data, tmp_path, capsys):
    root, _, _ = preference_data
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}),
                              json.dumps({"prompt": "a", "chosen": "", "rejected": "c"}),
                              json.dumps({"prompt": "a", "chosen": "b"}),
                              json.dumps({"prompt": "a", "chosen": "b", "rejected": ""}),
                              json.dumps({"prompt": "a", "chosen": "b", "rejected": 3})]) + "\n")
    args = ["data", "prepare", "--format", "preference", "--tokenizer", str(root / "tok"), "--cpus-per-task", "0", "--quiet"]
    assert main([*args, "--input", str(bad), "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(bad) in err[0] and "row 2" in err[0] and "empty 'chosen'" in err[0], err
    assert not (tmp_path / "refused" / "index.parquet").exists()
    assert main([*args, "--input", str(bad), "--out", str(tmp_path / "kept"), "--skip-bad"]) == 0
    captured = capsys.readouterr()
    assert "4 bad input(s) skipped" in captured.out
    skipped = [line for line in captured.err.splitlines() if line.startswith("skipped:")]
    assert len(skipped) == 4 and "row 3" in skipped[1] and "'rejected'" in skipped[1]
    assert "row 4" in skipped[2] and "empty 'rejected'" in skipped[2] and "row 5" in skipped[3]
    assert PreparedDataset(str(tmp_path / "kept"), 40, preference=True).samples == 1
    # Field names are overridable.
    (tmp_path / "named.jsonl").write_text(json.dumps({"q": "a", "good": "b", "bad": "c d"}) + "\n")
    assert main([*args, "--input", str(tmp_path / "named.jsonl"), "--out", str(tmp_path / "named"), "--prompt-field", "q",
                 "--chosen-field", "good", "--rejected-field", "bad"]) == 0
    capsys.readouterr()
    # A pair whose longer example passes --max-tokens is left out whole, named.
    assert main([*args, "--input", str(root / "in" / "a.jsonl"), "--out", str(tmp_path / "long"), "--max-tokens", "3"]) == 2
    line = capsys.readouterr().err.strip()
    assert "a.jsonl" in line and "row 1" in line and "--max-tokens 3" in line and "\n" not in line
    # A messages prompt with a tokenizer that has no chat template.
    plain = tmp_path / "plain-tok"
    tokenizer = load_tokenizer(str(root / "tok"))
    save_tokenizer(replace(tokenizer, config_json=json.dumps({"eos_token": tokenizer.eos_token})), str(plain))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "x"}], "chosen": "a",
                                                     "rejected": "b"}) + "\n")
    args[args.index("--tokenizer") + 1] = str(plain)
    assert main([*args, "--input", str(tmp_path / "chat.jsonl"), "--out", str(tmp_path / "nochat")]) == 2
    line = capsys.readouterr().err.strip()
    assert "chat template" in line and "row 1" in line and "\n" not in line
