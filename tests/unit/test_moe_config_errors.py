"""Bad mixture-of-experts input is refused by the CLI in one line naming the setting and the fix,
exit 2, no traceback, before Ray or any rank starts: layouts that cannot hold the experts, model
fields out of range, sequence parallelism, a resume naming other experts than the checkpoint's,
and a reshard plan onto an ep that does not divide them. In process (`main(argv)`): a case that
got past the checks would start Ray, and these tests would hang or fail, not pass."""
from __future__ import annotations

import pytest

from rayshard.cluster.cli.main import main
from rayshard.plans.training.model_spec import preset
from tests.unit.checkpoint_factory import write_checkpoint

SINGLE = ["--dp", "1", "--tp", "1"]


def _refused(capsys, monkeypatch, argv) -> str:
    monkeypatch.delenv("RAYSHARD_DEBUG", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def _model_file(tmp_path, **fields) -> str:
    path = tmp_path / "model.yaml"
    path.write_text("model:\n  preset: moe-tiny\n" + "".join(f"  {key}: {value}\n" for key, value in fields.items()))
    return str(path)


@pytest.mark.parametrize("flags, says", [
    (["--model", "moe-tiny", "--fsdp", "2", "--ep", "4"],
     "ep=4: expert parallelism splits the experts over the fsdp ranks, so ep must be 1 or equal fsdp (here 2). "
     "Fix: set --fsdp 4"),
    (["--model", "moe-tiny", "--fsdp", "4", "--ep", "2"], "ep must be 1 or equal fsdp (here 4)"),
    (["--model", "moe-tiny", "--dp", "2", "--ep", "2"], "ep must be 1 or equal fsdp (here 1)"),
    (["--model", "tiny", "--fsdp", "2", "--ep", "2"], "ep=2: expert parallelism needs a mixture-of-experts model"),
    (["--model", "moe-tiny", "--fsdp", "3", "--ep", "3"],
     "ep=3: must divide the number of experts (8). Fix: use ep (and fsdp) in [1, 2, 4, 8]"),
    (["--model", "moe-tiny", "--fsdp", "2", "--ep", "2", "--tp", "2", "--sp"],
     "sequence_parallel=True: is not supported with mixture-of-experts layers yet. Fix: drop --sp"),
])
def test_a_layout_that_cannot_hold_the_experts_is_refused(capsys, monkeypatch, tmp_path, flags, says):
    err = _refused(capsys, monkeypatch, ["train", *SINGLE, *flags, "--store", str(tmp_path / "s"), "--steps", "1"])
    assert says in err, err


@pytest.mark.parametrize("fields, flags, says", [
    (dict(n_experts=6), ["--fsdp", "4", "--ep", "4"], "ep=4: must divide the number of experts (6). Fix: use ep (and fsdp) in [1, 2, 3, 6]"),
    (dict(experts_per_token=9), [], "model.experts_per_token=9: must be between 1 and model.n_experts (8)"),
    (dict(experts_per_token=0), [], "model.experts_per_token=0: must be between 1 and model.n_experts (8)"),
    (dict(moe_every=5), [], "model.moe_every=5: leaves none of the 4 layers MoE"),
    (dict(expert_ffn_dim=31), ["--fsdp", "2", "--ep", "2", "--tp", "2"], "tp=2: must divide model.expert_ffn_dim (31)"),
    (dict(router_scores="relu"), [], "model.router_scores='relu': must be one of ['softmax', 'sigmoid']"),
])
def test_model_fields_out_of_range_are_refused(capsys, monkeypatch, tmp_path, fields, flags, says):
    argv = ["train", *SINGLE, "--config", _model_file(tmp_path, **fields), *flags, "--store", str(tmp_path / "s"),
            "--steps", "1"]
    assert says in _refused(capsys, monkeypatch, argv)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    store = str(tmp_path_factory.mktemp("moe") / "store")  # one checkpoint; every test only reads it
    write_checkpoint(store, "moe", preset("moe-tiny"))
    return store


def test_a_resume_with_other_experts_is_refused_naming_them(capsys, monkeypatch, tmp_path, moe_checkpoint):
    argv = ["train", *SINGLE, "--config", _model_file(tmp_path, n_experts=6), "--fsdp", "2", "--ep", "2",
            "--store", moe_checkpoint, "--run", "moe", "--resume", "latest", "--steps", "3"]
    assert "differs from the checkpoint's model in n_experts (8 -> 6)" in _refused(capsys, monkeypatch, argv)


def test_a_resume_onto_an_ep_that_does_not_divide_the_experts_is_refused(capsys, monkeypatch, moe_checkpoint):
    argv = ["train", *SINGLE, "--fsdp", "3", "--ep", "3", "--store", moe_checkpoint, "--run", "moe", "--resume", "latest",
            "--steps", "3"]
    assert "ep=3: must divide the number of experts (8)" in _refused(capsys, monkeypatch, argv)


@pytest.mark.parametrize("target, says", [
    ("fsdp=3,ep=3", "ep=3: must divide the number of experts (8)"),
    ("fsdp=4,ep=2", "ep must be 1 or equal fsdp (here 4)"),
])
def test_a_reshard_plan_onto_an_impossible_ep_is_refused(capsys, monkeypatch, moe_checkpoint, target, says):
    argv = ["ckpt", "plan", "moe", "--to", target, "--store", moe_checkpoint]
    assert says in _refused(capsys, monkeypatch, argv)


def test_a_reshard_plan_between_ep_degrees_prints_the_ranks(capsys, moe_checkpoint):
    assert main(["ckpt", "plan", "moe", "--to", "fsdp=4,ep=4", "--store", moe_checkpoint]) == 0
    out = capsys.readouterr().out
    assert "from single rank" in out and "to fsdp4(ep4) (4 ranks)" in out and "coverage proven" in out, out
