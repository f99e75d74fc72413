"""What the post-training tests (SFT and DPO) share: a prepared example dataset (a tokenizer
trained on the tests' words with a ChatML-style chat template, and rows split over a JSONL and a
Parquet file, so both readers and the row numbering across files are exercised), and one step's
loss and gradients gathered from the ranks."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from rayshard.cluster.data.documents import ReadOptions
from rayshard.cluster.data.prepare import prepare_dataset
from rayshard.cluster.data.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

# A ChatML-style template, as Qwen's tokenizer_config.json carries one.
TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
            "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
         "upsilon phi chi psi omega").split()


def prepare_examples(root: Path, rows: list[dict], options: ReadOptions, extra_words: str = ""):
    """root/tok (the tokenizer, returned) and root/ds (the dataset of `rows`: the first half from
    root/in/a.jsonl, the rest from root/in/b.parquet)."""
    words = " ".join([*WORDS * 20, *extra_words.split(), "<|im_start|>", "<|im_end|>"])
    (root / "text.txt").write_text(words)
    tokenizer = train_tokenizer([str(root / "text.txt")], 300)
    tokenizer = replace(tokenizer, config_json=json.dumps({"eos_token": tokenizer.eos_token, "chat_template": TEMPLATE}))
    save_tokenizer(tokenizer, str(root / "tok"))
    tokenizer = load_tokenizer(str(root / "tok"))
    half = len(rows) // 2
    (root / "in").mkdir()
    (root / "in" / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:half]) + "\n")
    pq.write_table(pa.Table.from_pylist(rows[half:]), root / "in" / "b.parquet")
    prepare_dataset([str(root / "in")], tokenizer, str(root / "ds"), options, cpus_per_task=0, log=lambda *_: None)
    return tokenizer


def one_step_gradients(rank_pool, config, loads: dict[str, str] | None = None) -> dict:
    """One step's loss and every parameter's gradient, gathered from the ranks of `config`'s layout
    (they must agree on the loss). loads: rank method -> checkpoint URL, called first, in order
    ("load" for the policy, "load_reference" for a DPO reference)."""
    from rayshard.cluster.run.rank_group import RankGroup

    group = RankGroup(config, rank_pool)
    try:
        for method, url in (loads or {}).items():
            group.call(method, url)
        results = group.call("full_gradients")
    finally:
        group.shutdown()
    assert len({result["loss"] for result in results}) == 1, "ranks disagree on the loss"
    gradients = {}
    for result in results:
        gradients.update(result["gradients"])
    return {"loss": results[0]["loss"], "gradients": gradients}
