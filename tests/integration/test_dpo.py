"""Direct Preference Optimization (`data prepare --format preference`, `--objective dpo`): prompt,
chosen and rejected rows become pairs of adjacent examples with loss masks on the responses; a
step draws whole pairs, never split across data ranks or microbatches; bad rows are refused in one
line naming the file and row. `--objective dpo`: one step's loss and gradients equal the DPO
paper's sigmoid loss computed with two transformers models; dp2 x tp2, fsdp2 and pp2 (live: the
reference's forward-only pass through the stages; or precomputed) equal one rank; LoRA's reference
is the base with adapters disabled; precomputed and live references give the same step; `ckpt
export` writes a DPO run's policy or adapter."""
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
from rayshard.plans.data.sample_order import batch_sample_ids
from rayshard.plans.errors import ConfigError
from tests.example_data import WORDS, one_step_gradients, prepare_examples

PREFERENCE = ReadOptions(format="preference")


def _rows(count: int, seed: int) -> list[dict]:
    """Asymmetric pairs: chosen and rejected of different lengths and words."""
    rng = np.random.default_rng(seed)
    words = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    return [{"prompt": f"{words(int(rng.integers(2, 8)))}:", "chosen": " " + words(int(rng.integers(1, 7))),
             "rejected": " " + words(int(rng.integers(1, 5)))} for _ in range(count)]


@pytest.fixture(scope="module")
def preference_data(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    rows = _rows(24, 0)
    tokenizer = prepare_examples(root, rows, PREFERENCE)
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
        pairs = reader.rank_pairs(7, 3, 8, data_rank, 2)
        got, pairs = pairs.windows, pairs.global_count
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


def _hf_llama(seed: int):
    import transformers

    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=320, hidden_size=48, intermediate_size=88, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False))
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.02)
    return hf


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """A policy and a reference of one shape with different weights, as transformers models and
    imported into a store (so the loss's reference term does not cancel)."""
    from rayshard.actors.checkpoint.stored import StoredCheckpoint
    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.checkpoint.hf_interop import import_hf
    from rayshard.plans.checkpoint.model_check import check_against_own_model

    root = tmp_path_factory.mktemp("models")
    store = Store(str(root / "store"))
    models, urls = {}, {}
    for name, seed in (("policy", 5), ("reference", 6)):
        models[name] = _hf_llama(seed)
        models[name].save_pretrained(str(root / name))
        import_hf(str(root / name), store, name, log=lambda *_: None)
        urls[name] = store.resolve(f"{name}@0").url
    stored = StoredCheckpoint(urls["policy"])
    spec = check_against_own_model(stored.chunks, stored.metadata, urls["policy"])
    return models, urls, spec


def _dpo_config(tmp_path, url: str, spec, layout=None, **overrides):
    from rayshard.plans.config import DataConfig, ModelChoice
    from tests.conftest import small_config

    values = dict(model=ModelChoice(preset="imported", spec=spec), data=DataConfig(dataset=url), global_batch=8,
                  seq_len=40, objective="dpo", run="dpo")
    values.update(overrides)
    return small_config(tmp_path, layout, **values)


def _one_step(rank_pool, config, policy: str, reference: str | None) -> dict:
    loads = {"load": policy} if reference is None else {"load": policy, "load_reference": reference}
    return one_step_gradients(rank_pool, config, loads)


def _paper_loss(policy, reference, inputs: torch.Tensor, labels: torch.Tensor, beta: float) -> torch.Tensor:
    """The DPO paper's sigmoid loss, written out: log-probabilities of each response's tokens from
    log_softmax, summed; chosen rows even, rejected odd; the mean over pairs."""
    def logps(model):
        logits = model(input_ids=inputs).logits[:, :-1].float()
        targets = labels[:, 1:]
        kept = targets != -100
        token = torch.log_softmax(logits, -1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (token * kept).sum(-1)

    with torch.no_grad():
        ref = logps(reference)
    pol = logps(policy)
    ratio = (pol[0::2] - ref[0::2]) - (pol[1::2] - ref[1::2])
    return -torch.nn.functional.logsigmoid(beta * ratio).mean()


def test_one_step_matches_the_paper_loss_with_two_transformers_models(preference_data, two_models, rank_pool, tmp_path):
    root, _, _ = preference_data
    models, urls, spec = two_models
    config = _dpo_config(tmp_path, str(root / "ds"), spec, microbatches=2)
    ours = _one_step(rank_pool, config, urls["policy"], urls["reference"])

    reader = PreparedDataset(str(root / "ds"), config.seq_len, preference=True)
    ids = batch_sample_ids(config.seed, 0, config.global_batch // 2, reader.samples)
    windows, masks = reader.read_examples(np.stack([2 * ids, 2 * ids + 1], 1).reshape(-1))
    inputs = torch.from_numpy(windows)
    labels = inputs.masked_fill(~torch.from_numpy(masks), -100)
    policy, reference = models["policy"], models["reference"]
    policy.zero_grad()
    expected = _paper_loss(policy, reference, inputs, labels, config.dpo.beta)
    expected.backward()
    assert abs(expected.item() - np.log(2)) > 1e-3  # the reference differs: its term does not cancel
    assert abs(ours["loss"] - expected.item()) <= 1e-6, (ours["loss"], expected.item())
    # The policy's gradients are transformers' (those parameters not fused here: qkv and gate_up are).
    theirs = {"tok_embeddings.weight": policy.model.embed_tokens.weight, "output.weight": policy.lm_head.weight,
              "norm.weight": policy.model.norm.weight}
    for index, layer in enumerate(policy.model.layers):
        theirs.update({f"layers.{index}.attention.wo.weight": layer.self_attn.o_proj.weight,
                       f"layers.{index}.feed_forward.down.weight": layer.mlp.down_proj.weight,
                       f"layers.{index}.attention_norm.weight": layer.input_layernorm.weight,
                       f"layers.{index}.ffn_norm.weight": layer.post_attention_layernorm.weight})
    # Within 1e-6 (decision 191): each element within 1e-6 relative, or 1e-7 absolute (1e-6 of the
    # largest gradients, ~0.1: near-zero entries are sums that cancel, whose own relative rounding is
    # unbounded in fp32), and each tensor's difference within 1e-6 of its norm.
    for name, param in theirs.items():
        torch.testing.assert_close(ours["gradients"][name], param.grad, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
        assert (ours["gradients"][name] - param.grad).norm() <= 1e-6 * param.grad.norm(), name
    # Every gradient is the policy's: the reference is frozen and has none.
    assert len(ours["gradients"]) == 15 and all(not name.startswith("reference") for name in ours["gradients"])


def test_dp2_tp2_and_fsdp2_give_the_one_rank_step(preference_data, two_models, rank_pool, tmp_path):
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    root, _, _ = preference_data
    _, urls, spec = two_models
    url = str(root / "ds")
    one = _one_step(rank_pool, _dpo_config(tmp_path / "one", url, spec, microbatches=2), urls["policy"], urls["reference"])
    for name, layout, microbatches in (("dp2xtp2", ParallelLayout(dp=2, tp=2), 2), ("fsdp2", ParallelLayout(fsdp=2), 1)):
        result = _one_step(rank_pool, _dpo_config(tmp_path / name, url, spec, layout, microbatches=microbatches),
                           urls["policy"], urls["reference"])
        assert abs(result["loss"] - one["loss"]) <= 1e-6 * abs(one["loss"]), (name, result["loss"], one["loss"])
        assert result["gradients"].keys() == one["gradients"].keys(), name
        for key, expected in one["gradients"].items():
            torch.testing.assert_close(result["gradients"][key], expected, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} {key}: {m}")


@pytest.mark.slow  # two short runs (dp2, then tp2) and a LoRA run; the default suite's DPO numerics are the tests above
def test_a_dpo_run_records_its_reference_reports_rewards_and_resumes_on_another_layout(preference_data, two_models,
                                                                                       run_training, tmp_path):
    from rayshard.actors.checkpoint.stored import StoredCheckpoint
    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.run.lora_base import base_digest
    from rayshard.cluster.run.metrics_sinks import read_metrics
    from rayshard.plans.config import LoraConfig
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    root, _, _ = preference_data
    _, urls, spec = two_models
    store = str(tmp_path / "store")
    Store(store)
    # The run starts from the imported policy: that checkpoint is its reference (a frozen copy).
    config = lambda **kw: _dpo_config(tmp_path, str(root / "ds"), spec, store=store, **{"steps": 3, **kw})  # noqa: E731
    whole = run_training(config(layout=ParallelLayout(dp=2), run="whole", resume=urls["policy"], ckpt_every=2))
    metadata = StoredCheckpoint(whole.checkpoints[0]).metadata
    assert metadata["objective"] == "dpo" and metadata["dpo"]["beta"] == 0.1
    assert metadata["dpo_reference"] == {"kind": "frozen-copy", "url": urls["policy"], "seed": 7,
                                         "digest": base_digest(urls["policy"])}
    records = {r["step"]: r for r in read_metrics(Store(store), "whole")}
    # Step 1: the policy is the reference, so every reward is 0 and the loss is log 2.
    assert abs(whole.losses[1] - np.log(2)) <= 1e-6 and records[1]["rewards_margin"] == 0
    # Later steps' pairs are others than those trained on: the policy has moved, the margin is no longer 0.
    assert records[3]["rewards_margin"] != 0 and 0 <= records[3]["rewards_accuracy"] <= 1
    assert records[3]["rewards_margin"] == pytest.approx(records[3]["rewards_chosen"] - records[3]["rewards_rejected"], abs=1e-6)
    # Resumed on tp2 (a new run from whole@2): the recorded reference is adopted; step 3 is the same.
    branch = run_training(config(layout=ParallelLayout(tp=2), run="branch", resume=f"{whole.checkpoints[0]}"))
    assert sorted(branch.losses) == [3]
    assert abs(branch.losses[3] - whole.losses[3]) <= 1e-5 * whole.losses[3], (branch.losses, whole.losses)
    assert StoredCheckpoint(branch.checkpoints[-1]).metadata["dpo_reference"] == metadata["dpo_reference"]
    # LoRA: the reference is the base with adapters disabled; step 1 computes log 2 (B starts at 0).
    lora = run_training(config(run="lora", steps=2, lora=LoraConfig(rank=4, base=urls["policy"])))
    # Step 2: the adapters moved, the reference (the base alone) did not, so the loss left log 2
    # (a reference that kept the adapters would give log 2 at every step).
    assert abs(lora.losses[1] - np.log(2)) <= 1e-6 and abs(lora.losses[2] - np.log(2)) > 1e-4
    recorded = StoredCheckpoint(lora.checkpoints[-1]).metadata["dpo_reference"]
    assert recorded["kind"] == "adapters-disabled" and recorded["url"] == urls["policy"]


def test_the_criterion_is_the_papers_sigmoid_and_ipo_loss_with_label_smoothing():
    """The criterion alone on made-up logits: the loss, rewards and accuracy against the formulas;
    prompt and padding targets (IGNORE) get exactly zero gradient."""
    from rayshard.actors.training.completion_loss import IGNORE
    from rayshard.actors.training.preference_loss import PreferenceLoss

    torch.manual_seed(0)
    logits = torch.randn(4, 6, 11, requires_grad=True)
    targets = torch.randint(0, 11, (4, 6))
    targets[:, :2] = IGNORE
    targets[1, 4:] = IGNORE  # a shorter rejected response
    reference = torch.randn(4)
    logps = (torch.log_softmax(logits.detach(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
             * (targets != IGNORE)).sum(-1)
    z = (logps[0::2] - reference[0::2]) - (logps[1::2] - reference[1::2])
    for loss, smoothing, expected in (
            ("sigmoid", 0.0, -torch.nn.functional.logsigmoid(0.5 * z)),
            ("sigmoid", 0.2, -0.8 * torch.nn.functional.logsigmoid(0.5 * z) - 0.2 * torch.nn.functional.logsigmoid(-0.5 * z)),
            ("ipo", 0.0, (z - 1 / (2 * 0.5)) ** 2)):
        criterion = PreferenceLoss(data_ranks=2, beta=0.5, loss=loss, label_smoothing=smoothing)
        criterion.set_step(global_pairs=8)
        criterion.set_reference(reference)
        got = criterion(logits, targets)
        torch.testing.assert_close(got, expected.sum() * 2 / 8, msg=loss)
        chosen, rejected = 0.5 * (logps[0::2] - reference[0::2]), 0.5 * (logps[1::2] - reference[1::2])
        assert criterion.rewards.tolist() == pytest.approx(
            [float(chosen.sum()) / 4, float(rejected.sum()) / 4, float((chosen - rejected).sum()) / 4,
             float((chosen > rejected).sum()) / 4], rel=1e-5)
    logits.grad = None
    got.backward()
    assert (logits.grad[:, :2] == 0).all() and (logits.grad[1, 4:] == 0).all() and (logits.grad[0, 4:] != 0).any()


def test_bad_dpo_settings_and_a_changed_reference_are_refused_in_one_line(preference_data, two_models, tmp_path):
    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.run.dpo_reference import resolve_reference
    from rayshard.plans.config import DpoConfig
    from rayshard.plans.errors import CheckpointError
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    root, _, _ = preference_data
    _, urls, spec = two_models
    url = str(root / "ds")
    for overrides, match in (
            (dict(global_batch=6), "multiple of 2 x dp\\*fsdp x microbatches = 4"),
            (dict(dpo=DpoConfig(beta=0.0)), "dpo.beta"),
            (dict(dpo=DpoConfig(loss="ipo", label_smoothing=0.1)), "applies to the sigmoid loss"),
            (dict(dpo=DpoConfig(label_smoothing=0.5)), "must be in \\[0, 0.5\\)")):
        layout = overrides.pop("layout", None)
        microbatches = overrides.pop("microbatches", 2)
        with pytest.raises(ConfigError, match=match) as refused:
            _dpo_config(tmp_path, url, spec, layout, microbatches=microbatches, **overrides)
        assert "\n" not in str(refused.value)
    # Text is not preference data.
    from rayshard.cluster.data.training_data import check_training_data
    from tests.conftest import small_config

    with pytest.raises(ConfigError, match="is text, not a prepared preference dataset.*--format preference"):
        check_training_data(small_config(tmp_path, objective="dpo"), None, None)
    # A resume whose recorded reference is another model's weights (its digest differs) is refused.
    config = _dpo_config(tmp_path, url, spec, microbatches=2)
    store = Store(str(tmp_path / "store"))
    recorded = {"dpo_reference": {"kind": "frozen-copy", "url": urls["reference"], "seed": 7, "digest": "sha256:other"}}
    with pytest.raises(CheckpointError, match="DPO reference .* has digest .* trained against digest sha256:other") as refused:
        resolve_reference(config, store, recorded, "some-run@2", None)
    assert "\n" not in str(refused.value)


def test_lora_dpo_on_dp2_tp2_and_pp2_gives_the_one_rank_step(preference_data, two_models, rank_pool, tmp_path):
    """With LoRA the reference is the base with adapters disabled: B starts at 0, so step 0's loss
    is log 2, and the adapters' gradients are the same on dp2 x tp2 and on pp2 (the stages'
    forward-only pass with adapters disabled, decision 190) as on one rank."""
    from rayshard.cluster.run.rank_group import RankGroup
    from rayshard.plans.config import LoraConfig
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    root, _, _ = preference_data
    _, urls, spec = two_models

    def step(layout, name):
        config = _dpo_config(tmp_path / name, str(root / "ds"), spec, layout, microbatches=2,
                             lora=LoraConfig(rank=4, base=urls["policy"]))
        group = RankGroup(config, rank_pool)
        try:
            group.call("load_base", urls["policy"])
            results = group.call("full_gradients")
        finally:
            group.shutdown()
        gradients = {}
        for result in results:
            gradients.update(result["gradients"])
        return results[0]["loss"], gradients

    loss, gradients = step(None, "one")
    assert abs(loss - np.log(2)) <= 1e-6
    assert gradients and all(".lora." in name for name in gradients)
    assert any(grad.abs().sum() > 0 for name, grad in gradients.items() if name.endswith(".b"))
    for name, layout in (("dp2xtp2", ParallelLayout(dp=2, tp=2)), ("pp2", ParallelLayout(pp=2))):
        other_loss, other_gradients = step(layout, name)
        assert abs(other_loss - loss) <= 1e-6 and other_gradients.keys() == gradients.keys(), name
        for key, expected in gradients.items():
            torch.testing.assert_close(other_gradients[key], expected, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name} {key}: {m}")



@pytest.mark.slow  # a second pp2 case; the default suite checks 1f1b's placement on pp2 above
def test_a_live_reference_on_a_v_placement_gives_the_one_rank_step(preference_data, two_models, rank_pool, tmp_path):
    """ZB-V on pp2 puts stages 0 and 3 on pp rank 0 and 1, 2 on rank 1: the reference's forward-only
    pass hands off within a rank, crosses twice and ends on rank 0 (decision 190). Fresh seeded
    weights (4 layers): the reference is the policy's starting copy, so the loss is log 2 exactly
    where the pass is right, and the gradients are one rank's."""
    from rayshard.plans.config import ModelChoice
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    root, _, _ = preference_data
    _, _, spec = two_models
    model = ModelChoice(preset="imported", spec=replace(spec, n_layers=4))
    url = str(root / "ds")
    one = one_step_gradients(rank_pool, _dpo_config(tmp_path / "one", url, spec, microbatches=4, model=model))
    v = one_step_gradients(rank_pool, _dpo_config(tmp_path / "zbv", url, spec, ParallelLayout(pp=2, vpp=2),
                                                  microbatches=4, schedule="zbv", model=model))
    assert abs(one["loss"] - np.log(2)) <= 1e-6 and abs(v["loss"] - one["loss"]) <= 1e-7, (one["loss"], v["loss"])
    assert v["gradients"].keys() == one["gradients"].keys()
    for key, expected in one["gradients"].items():
        torch.testing.assert_close(v["gradients"][key], expected, rtol=1e-6, atol=1e-7, msg=lambda m: f"zbv {key}: {m}")

def test_dpo_settings_come_from_flags_and_from_a_config_file():
    from rayshard.cluster.cli.commands.train import config_from_args
    from rayshard.cluster.cli.main import build_parser
    from rayshard.plans.config import DpoConfig, TrainConfig

    args = build_parser().parse_args(["train", "--objective", "dpo", "--dpo-beta", "0.25", "--dpo-loss", "ipo"])
    config = config_from_args(args)
    assert config.objective == "dpo" and config.dpo == DpoConfig(beta=0.25, loss="ipo")
    assert TrainConfig.from_dict({"objective": "dpo", "dpo": {"beta": 0.5, "label_smoothing": 0.1}}).dpo == \
        DpoConfig(beta=0.5, label_smoothing=0.1)
    with pytest.raises(ConfigError, match="dpo"):
        TrainConfig.from_dict({"dpo": {"betta": 0.5}})


def test_precomputed_reference_logprobs_give_the_live_step_and_another_reference_is_refused(
        preference_data, two_models, rank_pool, tmp_path):
    import shutil

    from rayshard.cluster.run.reference_logprobs import check_precomputed, compute_reference_logprobs
    from rayshard.cluster.run.dpo_reference import FROZEN_COPY, DpoReference
    from rayshard.cluster.run.lora_base import base_digest
    from rayshard.plans.config import DpoConfig

    root, _, _ = preference_data
    _, urls, spec = two_models
    shutil.copytree(root / "ds", tmp_path / "ds")
    url = str(tmp_path / "ds")
    reference = DpoReference(FROZEN_COPY, urls["reference"], 7, base_digest(urls["reference"]))
    with pytest.raises(ConfigError, match="holds no reference log-probabilities.*reference-logprobs --data") as refused:
        check_precomputed(url, reference)
    assert "\n" not in str(refused.value)
    store = urls["reference"].split("/reference/")[0]
    compute_reference_logprobs(url, urls["reference"], store, actors=rank_pool, log=lambda *_: None)
    own = check_precomputed(url, reference)  # its own reference: accepted, its file named for the ranks
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    live = _one_step(rank_pool, _dpo_config(tmp_path / "live", url, spec, microbatches=2), urls["policy"], urls["reference"])
    # Precomputed on one rank and on pp2, and live on pp2: the frozen copy's forward-only pass
    # through the stages before the schedule (decision 190).
    results = {}
    for name, layout, microbatches, precomputed in (("one", None, 2, True), ("pp2", ParallelLayout(pp=2), 4, True),
                                                    ("pp2 live", ParallelLayout(pp=2), 4, False)):
        results[name] = _one_step(rank_pool, _dpo_config(tmp_path / name, url, spec, layout, microbatches=microbatches,
                                                         dpo=DpoConfig(precomputed=precomputed, logprobs_file=own)),
                                  urls["policy"], None if precomputed else urls["reference"])
        assert results[name]["gradients"].keys() == live["gradients"].keys(), name
    # Live and precomputed on the same layout are the same step, bit for bit, on these CPU kernels
    # (decision 192): a row's log-probability does not depend on the rows batched beside it.
    for name, other in (("one", live), ("pp2", results["pp2 live"])):
        assert results[name]["loss"] == other["loss"], (name, results[name]["loss"], other["loss"])
        for key, expected in other["gradients"].items():
            assert torch.equal(results[name]["gradients"][key], expected), (name, key)
    # pp2 (4 microbatches) against one rank (2): the same up to the accumulation's rounding.
    assert abs(results["pp2"]["loss"] - live["loss"]) <= 1e-7, (results["pp2"]["loss"], live["loss"])
    for key, expected in live["gradients"].items():
        torch.testing.assert_close(results["pp2"]["gradients"][key], expected, rtol=1e-6, atol=1e-7, msg=lambda m: f"pp2 {key}: {m}")
    # A run whose reference is another checkpoint (the policy's weights) is refused in one line.
    other = DpoReference(FROZEN_COPY, urls["policy"], 7, base_digest(urls["policy"]))
    with pytest.raises(ConfigError, match="holds reference log-probabilities of .*/reference/.*but this run's "
                                          "reference is") as refused:
        check_precomputed(url, other)
    assert "\n" not in str(refused.value)


def test_two_references_files_sit_side_by_side_and_each_run_reads_its_own(preference_data, two_models, rank_pool,
                                                                          tmp_path):
    """One file per reference, named by its digest (decision 201): computing a second reference's
    log-probabilities leaves the first's; each precomputed run reads its own reference's file and
    gives the step of that live reference; a third reference is refused in one line naming both;
    a dataset's old single file is still read when its reference is the run's."""
    import shutil

    from rayshard.cluster.run.dpo_reference import FROZEN_COPY, DpoReference
    from rayshard.cluster.run.lora_base import base_digest
    from rayshard.cluster.run.reference_logprobs import check_precomputed, compute_reference_logprobs
    from rayshard.plans.config import DpoConfig
    from rayshard.plans.data.reference_logprobs import LEGACY_REFERENCE_LOGPROBS

    root, _, _ = preference_data
    _, urls, spec = two_models
    shutil.copytree(root / "ds", tmp_path / "ds")
    url = str(tmp_path / "ds")
    store = urls["reference"].split("/reference/")[0]
    references = {name: DpoReference(FROZEN_COPY, urls[name], 7, base_digest(urls[name])) for name in ("reference", "policy")}
    written = {name: compute_reference_logprobs(url, urls[name], store, actors=rank_pool, log=lambda *_: None)
               for name in references}
    files = {name: check_precomputed(url, reference) for name, reference in references.items()}
    assert len(set(files.values())) == 2 and all((tmp_path / "ds" / file).exists() for file in files.values())
    assert {name: f"{url}/{file}" for name, file in files.items()} == written
    losses = {}
    for name, reference in references.items():
        precomputed = _one_step(rank_pool, _dpo_config(tmp_path / f"pre-{name}", url, spec, microbatches=2,
                                                       dpo=DpoConfig(precomputed=True, logprobs_file=files[name])),
                                urls["policy"], None)
        live = _one_step(rank_pool, _dpo_config(tmp_path / f"live-{name}", url, spec, microbatches=2),
                         urls["policy"], urls[name])
        # The 1e-6 (fp32); with the policy as its own reference the two differ in the last bits.
        assert abs(precomputed["loss"] - live["loss"]) <= 1e-6, (name, precomputed["loss"], live["loss"])
        losses[name] = precomputed["loss"]
    assert abs(losses["reference"] - losses["policy"]) > 1e-3  # two references, two steps: each read its own file
    assert live["loss"] == pytest.approx(np.log(2), abs=1e-6)  # the policy as its own reference
    # A third reference: refused in one line naming the two the dataset has.
    third = DpoReference(FROZEN_COPY, "file:///elsewhere/ckpt", 7, "sha256:" + "f" * 64)
    with pytest.raises(ConfigError, match="holds reference log-probabilities of") as refused:
        check_precomputed(url, third)
    line = str(refused.value)
    assert "\n" not in line and urls["reference"] in line and urls["policy"] in line and "elsewhere" in line, line
    # A dataset prepared before: its one reference-logprobs.parquet is read when it is the run's reference's.
    (tmp_path / "ds" / files["reference"]).rename(tmp_path / "ds" / LEGACY_REFERENCE_LOGPROBS)
    assert check_precomputed(url, references["reference"]) == LEGACY_REFERENCE_LOGPROBS
    assert check_precomputed(url, references["policy"]) == files["policy"]


@pytest.mark.slow  # a precompute and a run; the default suite checks the same numbers above
def test_a_precomputed_run_runs_no_reference(preference_data, two_models, rank_pool, run_training, tmp_path):
    """The run's driver checks the file against its reference and loads none. (The CLI's own actor
    cannot start here: the session's actor pool holds every CPU; so the command's function runs on
    the pool, and the parser is checked apart.)"""
    import shutil

    from rayshard.plans.config import DpoConfig

    root, _, _ = preference_data
    _, urls, spec = two_models
    shutil.copytree(root / "ds", tmp_path / "ds")
    url = str(tmp_path / "ds")
    store = urls["policy"].split("/policy/")[0]
    from rayshard.cluster.cli.main import build_parser
    from rayshard.cluster.run.reference_logprobs import compute_reference_logprobs

    args = build_parser().parse_args(["data", "reference-logprobs", "--data", url, "--from", "policy@0", "--store", store])
    assert (args.data, args.reference, args.store) == (url, "policy@0", store)
    lines = []
    compute_reference_logprobs(args.data, args.reference, args.store, actors=rank_pool, log=lines.append)
    assert "/reference-logprobs/" in lines[0] and ".parquet: 48 examples" in lines[0]
    # The run starts from the policy, which is therefore its reference: step 1's loss is log 2.
    result = run_training(_dpo_config(tmp_path, url, spec, steps=1, run="pre", resume=urls["policy"],
                                      dpo=DpoConfig(precomputed=True)))
    assert abs(result.losses[1] - np.log(2)) <= 1e-6


@pytest.mark.slow  # two 20-step runs per case; the default suite checks the same step on each layout above
@pytest.mark.parametrize("precomputed", [True, False], ids=["precomputed", "live"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_dpo_run_on_dp2_tp2_resumed_on_pp2_continues_the_uninterrupted_losses(preference_data, two_models, rank_pool,
                                                                                run_training, tmp_path, lora, precomputed):
    """The issue's acceptance: a DPO run (full and LoRA) on dp2 x tp2 resumed on pp2 continues the
    uninterrupted run within 2.5e-6 relative per step for the rest of 20 steps, with the reference
    precomputed (both runs read the same file) or live (on pp2 its forward-only pass through the
    stages, decision 190)."""
    import shutil

    from rayshard.cluster.run.reference_logprobs import compute_reference_logprobs
    from rayshard.plans.config import DpoConfig, LoraConfig
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    root, _, _ = preference_data
    _, urls, spec = two_models
    shutil.copytree(root / "ds", tmp_path / "ds")
    url = str(tmp_path / "ds")
    if precomputed:
        compute_reference_logprobs(url, urls["policy"], urls["policy"].split("/policy/")[0], actors=rank_pool,
                                   log=lambda *_: None)
    method = dict(lora=LoraConfig(rank=4, base=urls["policy"])) if lora else {}
    config = lambda layout, run, **kw: _dpo_config(  # noqa: E731
        tmp_path, url, spec, layout, store=str(tmp_path / "store"), steps=20, microbatches=2,
        dpo=DpoConfig(precomputed=precomputed), run=run, **method, **kw)
    start = {} if lora else dict(resume=urls["policy"])  # full DPO starts from the policy, its reference
    whole = run_training(config(ParallelLayout(dp=2, tp=2), "whole", ckpt_every=10, **start))
    assert sorted(whole.losses) == list(range(1, 21))
    resumed = run_training(config(ParallelLayout(pp=2), "resumed", resume=whole.checkpoints[0]))
    assert sorted(resumed.losses) == list(range(11, 21))
    for step in range(11, 21):
        assert abs(resumed.losses[step] - whole.losses[step]) <= 2.5e-6 * abs(whole.losses[step]), \
            (step, resumed.losses[step], whole.losses[step])


def test_ckpt_export_of_a_dpo_run_writes_the_policy_or_its_adapter(preference_data, two_models, run_training, tmp_path):
    """Issue 40: `ckpt export` of a full DPO run writes the trained policy (no reference tensors),
    and of a LoRA DPO run its adapter, which peft loads onto the base. One step each, one rank."""
    import peft
    import transformers

    from rayshard.actors.checkpoint.stored import StoredCheckpoint
    from rayshard.plans.config import LoraConfig
    from tests.peft_models import our_model

    root, _, _ = preference_data
    models, urls, spec = two_models
    store = str(tmp_path / "store")
    config = lambda **kw: _dpo_config(tmp_path, str(root / "ds"), spec, store=store, steps=1, microbatches=2, **kw)  # noqa: E731
    # Full: the run starts from the policy (its reference, a frozen copy) and trains it one step.
    full = run_training(config(run="full", resume=urls["policy"]))
    assert main(["ckpt", "export", "full", "--out", str(tmp_path / "full-hf"), "--no-optimizer", "--store", store]) == 0
    exported = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "full-hf"), dtype=torch.float32).state_dict()
    started = models["policy"].state_dict()
    assert sorted(exported) == sorted(started)  # the policy's tensors only: the reference is not in the checkpoint
    stored = StoredCheckpoint(full.checkpoints[-1])
    for ours, theirs in (("output.weight", "lm_head.weight"), ("tok_embeddings.weight", "model.embed_tokens.weight"),
                         ("layers.1.attention.wo.weight", "model.layers.1.self_attn.o_proj.weight")):
        trained = stored.read_region(ours, "param", (0, 0), tuple(exported[theirs].shape))
        assert torch.equal(exported[theirs], trained), theirs  # the trained policy, as stored
        assert not torch.equal(exported[theirs], started[theirs]), theirs  # which one step moved
    # LoRA: the adapter, as PEFT's files; on the base's Hugging Face directory it computes our model.
    lora = run_training(config(run="lora", lora=LoraConfig(rank=4, base=urls["policy"])))
    assert main(["ckpt", "export", "lora", "--format", "peft", "--out", str(tmp_path / "peft"), "--store", store]) == 0
    tokens = torch.randint(0, 320, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # The adapter names the Hugging Face directory its base (the policy) was imported from.
        base_dir = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"]
        base = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        base_logits = base(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()(tokens).logits
        assert (adapted - base_logits).abs().max() > 1e-6  # the adapter moved in one step (B starts at 0)
        assert (adapted - our_model(lora.checkpoints[-1])(tokens)).abs().max().item() <= 1e-5


def test_references_files_on_an_object_store_are_written_side_by_side_and_picked_by_digest(s3_store):
    """The same on S3 (moto): each reference's file is a put of its own, the driver lists them and
    picks the run's; with none of its reference the line names those there (decision 201)."""
    import fsspec

    from rayshard.cluster.run.dpo_reference import FROZEN_COPY, DpoReference
    from rayshard.cluster.run.reference_logprobs import check_precomputed, write_reference_logprobs
    from rayshard.plans.data.reference_logprobs import LEGACY_REFERENCE_LOGPROBS, encode_reference_logprobs

    url = s3_store.replace("/store", "/prefs")
    ref = lambda name, hexdigit: DpoReference(FROZEN_COPY, f"s3://models/{name}", 7, "sha256:" + hexdigit * 64)  # noqa: E731
    a, b, old, other = ref("a", "a"), ref("b", "b"), ref("old", "c"), ref("other", "d")
    with pytest.raises(ConfigError, match="holds no reference log-probabilities"):
        check_precomputed(url, a)
    names = {r.url: write_reference_logprobs(url, np.arange(4.0) * i, "index", {"url": r.url, "digest": r.digest})
             for i, r in enumerate((a, b))}
    fs, root = fsspec.core.url_to_fs(url)
    fs.pipe_file(f"{root}/{LEGACY_REFERENCE_LOGPROBS}", encode_reference_logprobs(
        np.zeros(4), "index", {"url": old.url, "digest": old.digest}))
    fs.invalidate_cache()
    assert len(set(names.values())) == 2
    assert [check_precomputed(url, r) for r in (a, b, old)] == [names[a.url], names[b.url], LEGACY_REFERENCE_LOGPROBS]
    with pytest.raises(ConfigError) as refused:
        check_precomputed(url, other)
    line = str(refused.value)
    assert "\n" not in line and all(r.url in line for r in (a, b, old, other)), line

