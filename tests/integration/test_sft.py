"""Supervised fine-tuning (`data prepare --format sft`, `--objective sft`): examples from JSONL and
Parquet become token shards with loss masks (1 on completion tokens); a conversation is rendered
as transformers' `apply_chat_template` renders it; one step's loss equals transformers' loss with
labels -100 on the prompt, and prompt-only tokens get no gradient; dp2 x tp2 and pp2 give the
1-rank loss and gradients; bad rows are refused in one line naming the file and row."""
from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from rayshard.actors.training.dataset_reader import PreparedDataset
from rayshard.cluster.cli.main import main
from rayshard.cluster.data.documents import ReadOptions
from rayshard.cluster.data.prepare import prepare_dataset
from rayshard.cluster.data.tokenizer import load_tokenizer, save_tokenizer
from rayshard.plans.config import DataConfig, ModelChoice
from rayshard.plans.data.sample_order import batch_sample_ids
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.conftest import small_config
from tests.example_data import WORDS, one_step_gradients, prepare_examples

SFT = ReadOptions(format="sft")
PROMPT_ONLY = "QQQQ"  # a word only prompts hold: its token's embedding row must get no gradient


def _rows(count: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    return [{"prompt": f"{PROMPT_ONLY} {words(int(rng.integers(2, 8)))}:", "completion": " " + words(int(rng.integers(1, 6)))}
            for _ in range(count)]


@pytest.fixture(scope="module")
def sft_data(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    rows = _rows(24, 0)
    tokenizer = prepare_examples(root, rows, SFT, extra_words=PROMPT_ONLY)
    return root, tokenizer, rows


def test_examples_become_tokens_with_masks_on_the_completion(sft_data):
    root, tokenizer, rows = sft_data
    reader = PreparedDataset(str(root / "ds"), 40, sft=True)
    assert reader.samples == len(rows) and reader.meta.kind == "sft"
    windows, masks = reader.read_examples(np.arange(len(rows)))
    eos = tokenizer.eos_id
    for row, window, mask in zip(rows, windows, masks):
        prompt = tokenizer.tokenizer.encode(row["prompt"], add_special_tokens=False).ids
        completion = tokenizer.tokenizer.encode(row["completion"], add_special_tokens=False).ids + [eos]
        length = len(prompt) + len(completion)
        assert window[:length].tolist() == prompt + completion
        assert mask.tolist() == [False] * len(prompt) + [True] * len(completion) + [False] * (41 - length)
        assert (window[length:] == eos).all()  # padding, masked out
    # Global batch step 0's completion targets, from the index alone, are those the masks hold.
    counted = reader.rank_examples(7, 0, 8, 0, 2).global_count
    ids = batch_sample_ids(7, 0, 8, reader.samples)
    assert counted == int(masks[ids][:, 1:].sum())


def test_a_conversation_is_rendered_as_transformers_renders_it(sft_data, tmp_path):
    from transformers import AutoTokenizer

    root, tokenizer, _ = sft_data
    messages = [{"role": "system", "content": "alpha beta"}, {"role": "user", "content": "gamma delta?"},
                {"role": "assistant", "content": "epsilon zeta"}]
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": messages}) + "\n")
    prepare_dataset([str(tmp_path / "chat.jsonl")], tokenizer, str(tmp_path / "ds"), SFT, cpus_per_task=0, log=lambda *_: None)
    window, mask = PreparedDataset(str(tmp_path / "ds"), 160, sft=True).read_examples(np.asarray([0]))
    hf = AutoTokenizer.from_pretrained(str(root / "tok"))
    whole = hf.apply_chat_template(messages, tokenize=False)
    prompt = hf.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    ids = (tokenizer.tokenizer.encode(prompt, add_special_tokens=False).ids
           + tokenizer.tokenizer.encode(whole[len(prompt):], add_special_tokens=False).ids + [tokenizer.eos_id])
    assert tokenizer.tokenizer.decode(window[0, :len(ids)].tolist(), skip_special_tokens=False) == whole + tokenizer.eos_token
    assert window[0, :len(ids)].tolist() == ids
    assert tokenizer.tokenizer.decode(window[0][mask[0]].tolist(), skip_special_tokens=False) == \
        "epsilon zeta<|im_end|>\n" + tokenizer.eos_token


def test_bad_rows_are_named_in_one_line_and_counted_when_skipped(sft_data, tmp_path, capsys):
    root, _, _ = sft_data
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join([json.dumps({"prompt": "a", "completion": "b"}), json.dumps({"prompt": "a"}),
                              "{not json", json.dumps({"prompt": "a", "completion": ""}),
                              json.dumps({"messages": [{"role": "user", "content": "x"}]})]) + "\n")
    args = ["data", "prepare", "--format", "sft", "--tokenizer", str(root / "tok"), "--cpus-per-task", "0", "--quiet"]
    assert main([*args, "--input", str(bad), "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}" in err[0] and "row 2" in err[0] and "'completion'" in err[0], err
    assert not (tmp_path / "refused" / "index.parquet").exists()
    assert main([*args, "--input", str(bad), "--out", str(tmp_path / "kept"), "--skip-bad"]) == 0
    captured = capsys.readouterr()
    assert "4 bad input(s) skipped" in captured.out
    skipped = [line for line in captured.err.splitlines() if line.startswith("skipped:")]
    assert [("row 2" in s, "row 3" in s, "row 4" in s, "row 5" in s) for s in skipped] == [
        (True, False, False, False), (False, True, False, False), (False, False, True, False), (False, False, False, True)]
    assert "'assistant'" in skipped[3]
    # --max-tokens refuses a longer example, naming it.
    assert main([*args, "--input", str(root / "in" / "a.jsonl"), "--out", str(tmp_path / "long"), "--max-tokens", "3"]) == 2
    line = capsys.readouterr().err.strip()
    assert "a.jsonl" in line and "row 1" in line and "--max-tokens 3" in line and "\n" not in line
    # A conversation with a tokenizer that has no chat template.
    plain = tmp_path / "plain-tok"
    tokenizer = load_tokenizer(str(root / "tok"))
    save_tokenizer(replace(tokenizer, config_json=json.dumps({"eos_token": tokenizer.eos_token})), str(plain))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "assistant", "content": "x"}]}) + "\n")
    args[args.index("--tokenizer") + 1] = str(plain)
    assert main([*args, "--input", str(tmp_path / "chat.jsonl"), "--out", str(tmp_path / "nochat")]) == 2
    line = capsys.readouterr().err.strip()
    assert "chat template" in line and "row 1" in line and "\n" not in line


def _sft_config(tmp_path, url: str, layout=None, **overrides):
    values = dict(model=ModelChoice.named("tiny", vocab_size=320), data=DataConfig(dataset=url), global_batch=8,
                  seq_len=40, objective="sft", run="sft")
    values.update(overrides)
    return small_config(tmp_path, layout, **values)


def test_sft_on_a_text_dataset_or_too_short_sequences_is_refused(sft_data, tmp_path):
    root, _, _ = sft_data
    with pytest.raises(ConfigError, match="seq_len.*row.*--max-tokens"):
        PreparedDataset(str(root / "ds"), 6, sft=True)
    from rayshard.cluster.data.training_data import check_training_data

    with pytest.raises(ConfigError, match="is text, not a prepared SFT dataset"):
        check_training_data(small_config(tmp_path, objective="sft"), None, None)


def _one_step(rank_pool, config, load: str | None = None) -> dict:
    return one_step_gradients(rank_pool, config, {"load": load} if load is not None else None)


def test_one_step_matches_transformers_and_prompts_get_no_gradient(sft_data, rank_pool, tmp_path):
    import transformers

    from rayshard.actors.checkpoint.stored import StoredCheckpoint
    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.checkpoint.hf_interop import import_hf
    from rayshard.plans.checkpoint.model_check import check_against_own_model

    root, tokenizer, _ = sft_data
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False))
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    hf.save_pretrained(str(tmp_path / "hf"))
    store = Store(str(tmp_path / "store"))
    import_hf(str(tmp_path / "hf"), store, "imported", log=lambda *_: None)
    url = store.resolve("imported@0").url
    stored = StoredCheckpoint(url)
    spec = check_against_own_model(stored.chunks, stored.metadata, url)
    config = _sft_config(tmp_path, str(root / "ds"), model=ModelChoice(preset="imported", spec=spec), microbatches=2)
    ours = _one_step(rank_pool, config, load=url)

    reader = PreparedDataset(str(root / "ds"), config.seq_len, sft=True)
    windows, masks = reader.read_examples(batch_sample_ids(config.seed, 0, config.global_batch, reader.samples))
    inputs = torch.from_numpy(windows)
    labels = inputs.masked_fill(~torch.from_numpy(masks), -100)
    hf.train()
    expected = hf(input_ids=inputs, labels=labels).loss
    expected.backward()
    assert abs(ours["loss"] - expected.item()) <= 1e-6, (ours["loss"], expected.item())
    # Every gradient of the embedding and the output layer is transformers' masked one.
    for name, theirs in (("tok_embeddings.weight", hf.model.embed_tokens.weight), ("output.weight", hf.lm_head.weight)):
        torch.testing.assert_close(ours["gradients"][name], theirs.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    # A prompt token is context (completion positions attend to it, so its embedding does get
    # gradient, in transformers too), never a target: the loss's gradient at prompt positions is 0.
    # Positions whose targets are only prompt tokens: the output row of a token only prompts hold
    # gets no "-1 at its target" term, which it would with the prompt counted.
    prompt_only = tokenizer.tokenizer.encode(PROMPT_ONLY, add_special_tokens=False).ids
    assert prompt_only and all(token in windows and token not in windows[masks] for token in prompt_only)
    hf.zero_grad()
    hf(input_ids=inputs, labels=inputs).loss.backward()  # the prompt counted
    for token in prompt_only:
        assert not torch.allclose(ours["gradients"]["output.weight"][token], hf.lm_head.weight.grad[token], atol=1e-4)


def test_a_step_reports_its_examples_tokens_not_the_padded_rows(sft_data, rank_pool, tmp_path):
    """tokens (and so tokens/s) count each example's own tokens, padding left out: the sum of the
    step's examples' lengths, not rows x seq_len (decision 203); MFU's positions stay rows x seq_len."""
    from rayshard.cluster.run.rank_group import RankGroup

    root, tokenizer, rows = sft_data
    config = _sft_config(tmp_path, str(root / "ds"), ParallelLayout(dp=2))
    group = RankGroup(config, rank_pool)
    try:
        metrics = group.call("train_step")
    finally:
        group.shutdown()
    encode = lambda text: tokenizer.tokenizer.encode(text, add_special_tokens=False).ids  # noqa: E731
    # The dataset's rows in document order are the rows (a.jsonl's half, then b.parquet's).
    lengths = [len(encode(row["prompt"])) + len(encode(row["completion"])) + 1 for row in rows]
    assert max(lengths) < config.seq_len
    ids = batch_sample_ids(config.seed, 0, config.global_batch, len(rows))
    for data_rank, rank_metrics in enumerate(metrics):
        mine = ids[data_rank * 4:(data_rank + 1) * 4]
        assert rank_metrics.tokens == sum(lengths[i] for i in mine), data_rank
        assert rank_metrics.computed_tokens == 4 * config.seq_len
    assert sum(m.tokens for m in metrics) == sum(lengths[i] for i in ids) < config.global_batch * config.seq_len


def test_prompt_positions_get_no_gradient():
    """The criterion alone: a prompt or padding target (IGNORE) gets exactly zero gradient, and the
    loss is its completion tokens' sum times data_ranks / the global count."""
    from rayshard.actors.training.completion_loss import IGNORE, CompletionLoss

    logits = torch.randn(2, 5, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    targets[0, :3] = IGNORE
    targets[1, :1] = IGNORE
    criterion = CompletionLoss(data_ranks=2)
    criterion.set_step(12)
    loss = criterion(logits, targets)
    loss.backward()
    assert (logits.grad[0, :3] == 0).all() and (logits.grad[1, :1] == 0).all()
    assert (logits.grad[0, 3:] != 0).all()
    kept = targets != IGNORE
    expected = torch.nn.functional.cross_entropy(logits[kept], targets[kept], reduction="sum") * 2 / 12
    assert torch.allclose(loss, expected)


@pytest.mark.slow  # decision 200: DPO's dp2 x tp2 and pp2 one-step cases run the same masked loss on those layouts
def test_dp2_tp2_and_pp2_give_the_one_rank_step(sft_data, rank_pool, tmp_path):
    root, _, _ = sft_data
    url = str(root / "ds")
    reference = _one_step(rank_pool, _sft_config(tmp_path / "one", url))
    for name, layout, microbatches in (("dp2xtp2", ParallelLayout(dp=2, tp=2), 2), ("pp2", ParallelLayout(pp=2), 4),
                                       ("fsdp2", ParallelLayout(fsdp=2), 1)):
        result = _one_step(rank_pool, _sft_config(tmp_path / name, url, layout, microbatches=microbatches))
        assert abs(result["loss"] - reference["loss"]) <= 1e-6 * abs(reference["loss"]), (name, result["loss"], reference["loss"])
        assert result["gradients"].keys() == reference["gradients"].keys(), name
        for key, expected in reference["gradients"].items():
            torch.testing.assert_close(result["gradients"][key], expected, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} {key}: {m}")


@pytest.mark.slow  # a run and a resume; the default suite checks the step on pp2 above (decision 178)
def test_an_sft_run_records_its_objective_and_data_and_resumes_on_pp2(sft_data, run_training, tmp_path):
    from rayshard.actors.checkpoint.stored import StoredCheckpoint
    from rayshard.cluster.cli.commands.train import config_from_args
    from rayshard.cluster.cli.main import build_parser

    root, _, _ = sft_data
    args = ["train", "--store", str(tmp_path / "store"), "--data", str(root / "ds"), "--objective", "sft",
            "--global-batch", "8", "--seq-len", "40", "--ckpt-every", "2", "--seed", "7", "--dp", "2"]
    whole = run_training(config_from_args(build_parser().parse_args([*args, "--run", "whole", "--steps", "4"])))
    metadata = StoredCheckpoint(whole.checkpoints[0]).metadata
    assert metadata["objective"] == "sft"
    assert metadata["data_position"]["dataset"]["index_hash"] == PreparedDataset(str(root / "ds"), 40).meta.index_hash
    args[args.index("--dp") + 1] = "1"
    piped = run_training(config_from_args(build_parser().parse_args([*args, "--run", "piped", "--steps", "4", "--pp", "2",
                                                                      "--resume", "whole@2"])))
    assert sorted(piped.losses) == [3, 4]
    for step, loss in piped.losses.items():
        assert abs(loss - whole.losses[step]) <= 1e-5 * whole.losses[step], (step, loss, whole.losses[step])


@pytest.mark.slow  # decision 153: object-store prepare is test_data_prepare's; this adds the masks
def test_examples_on_an_object_store_prepare_to_the_same_dataset(sft_data, object_store, capsys):
    """Inputs and output on S3 (moto; Azurite under -m slow): the same examples give the same index
    hash (tokens and masks) as the local preparation, and read back the same."""
    import fsspec

    root, _, rows = sft_data
    url = object_store.url
    fs, base = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{base}/in/a.jsonl", (root / "in" / "a.jsonl").read_bytes())
    fs.pipe_file(f"{base}/in/b.parquet", (root / "in" / "b.parquet").read_bytes())
    assert main(["data", "prepare", "--format", "sft", "--tokenizer", str(root / "tok"), "--input", f"{url}/in",
                 "--out", f"{url}/ds", "--cpus-per-task", "0", "--quiet"]) == 0
    assert f"prepared {url}/ds: {len(rows)} documents" in capsys.readouterr().out
    local, remote = PreparedDataset(str(root / "ds"), 40, sft=True), PreparedDataset(f"{url}/ds", 40, sft=True)
    assert remote.meta.index_hash == local.meta.index_hash
    for theirs, ours in zip(remote.read_examples(np.arange(len(rows))), local.read_examples(np.arange(len(rows)))):
        assert (theirs == ours).all()


def test_a_damaged_mask_is_refused(sft_data, tmp_path):
    import shutil

    root, _, _ = sft_data
    shutil.copytree(root / "ds", tmp_path / "ds")
    mask = next((tmp_path / "ds").glob("attempt-*/shard-*.mask"))
    data = bytearray(mask.read_bytes())
    data[0] ^= 1  # a prompt token would now count
    mask.write_bytes(bytes(data))
    reader = PreparedDataset(str(tmp_path / "ds"), 40, sft=True)
    shard = reader.meta.masks.index(f"{mask.parent.name}/{mask.name}")
    first = int(np.flatnonzero((reader.example_shard == shard) & (reader.example_start == 0))[0])
    with pytest.raises(Exception, match=r"\.mask: the loss mask at tokens \[0, .* does not match the index's CRC32"):
        reader.read_examples(np.asarray([first]))
