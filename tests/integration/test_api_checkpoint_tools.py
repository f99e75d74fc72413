"""`rayshard ckpt reshard / export / plan` on checkpoints `rayshard.checkpoint` wrote (decisions
128-130): a training loop's state dict saved by two real gloo ranks (forked, no Ray), under
rayshard's names or torchtitan's, with the model given on the command line or recorded at save.
Each copy is checked bit for bit against the same state written by rayshard's own writer
(`ckpt digest`, `ckpt diff`), and each refusal is one line with nothing committed."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from safetensors.torch import load_file

import rayshard.checkpoint as ckpt
from rayshard.actors.checkpoint.save import save_rank_shard
from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint
from rayshard.cluster.cli.commands.train import config_from_args
from rayshard.cluster.cli.main import build_parser, main
from rayshard.cluster.run.resume_model import checkpoint_model
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.errors import CheckpointError
from rayshard.plans.interop.model_description import ModelDescription
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import parameter_shapes, preset
from rayshard.storage.manifest_io import read_manifest
from tests.forked_ranks import run_ranks
from tests.integration.reshard_helpers import digests
from tests.torchtitan_llama import torchtitan_from_ours
from tests.unit.checkpoint_factory import trained_model, write_checkpoint

CONFIG = preset("tiny")
STEP = 2
MOMENTS = ("exp_avg", "exp_avg_sq")


@pytest.fixture(autouse=True)
def _bounded_exchanges(monkeypatch):
    monkeypatch.setenv("RAYSHARD_CHECKPOINT_TIMEOUT_S", "60")  # forked ranks inherit it


def _whole(url: str, kind: str) -> dict[str, torch.Tensor]:
    stored = StoredCheckpoint(url)
    return {name: stored.read_region(name, kind, (0,) * len(shape), tuple(shape))
            for name, shape in parameter_shapes(CONFIG).items()}


def _state_dict(url: str, names: str, extras: bool = True) -> dict:
    """The source checkpoint's state as a loop's `get_state_dict` gives it: {"model": ...,
    "optim": {"state": {fqn: {step, exp_avg, exp_avg_sq}}, "param_groups": [...]}}, under our
    names or torchtitan's; plus a tensor and a value of the loop's own."""
    convert = (lambda state: state) if names == "rayshard" else (lambda state: torchtitan_from_ours(state, CONFIG))
    weights = convert(_whole(url, "param"))
    moments = {kind: convert(_whole(url, kind)) for kind in MOMENTS}
    state = {name: {"step": torch.tensor(float(STEP)), **{kind: moments[kind][name] for kind in MOMENTS}} for name in weights}
    saved = {"model": weights, "optim": {"state": state, "param_groups": [{"lr": 0.01, "params": sorted(weights)}]}}
    return {**saved, "rng": torch.arange(4, dtype=torch.int64), "data": {"next_batch": 7}} if extras else saved


def _save_rank(rank: int, init_method: str, world_size: int, results, spec: dict) -> None:
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
        ref = ckpt.save(_state_dict(spec["source"], spec["names"], spec["extras"]), spec["where"], step=STEP,
                        model=spec.get("model"))
        results[rank] = {"url": ref.url}
    except Exception as error:
        results[rank] = {"error": f"{type(error).__name__}: {error}"}
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _save(source: str, where: str, names: str, model: dict | None = None, extras: bool = True) -> list[dict]:
    results = run_ranks(_save_rank, 2, {"source": source, "where": where, "names": names, "model": model,
                                        "extras": extras})
    return [results[rank] for rank in range(2)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The source (rayshard's writer, tiny, 2 AdamW steps) and its state saved through the API by
    2 gloo ranks under each naming, no model recorded."""
    root = tmp_path_factory.mktemp("api-tools")
    store = str(root / "runs")
    source, _, _ = write_checkpoint(store, "src", CONFIG, steps=STEP)
    for names in ("rayshard", "torchtitan"):
        reports = _save(source, f"{store}/api-{names}", names)
        assert all("error" not in report for report in reports), reports
    return store, source


def _cli(capsys, *argv: str) -> tuple[int, list[str], list[str]]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out.strip().splitlines(), err.strip().splitlines()


def _refused(capsys, *argv: str) -> str:
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0], (code, err)
    return err[0]


def _hf_tensors(directory: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(directory, "model.safetensors"))


@pytest.mark.parametrize("names", ["rayshard", "torchtitan"])
def test_reshard_and_hf_export_take_the_model_from_the_command_line(saved, names, tmp_path, capsys):
    store, source = saved
    run = f"api-{names}@{STEP}"
    model = ["--model", "tiny"] + (["--names", "torchtitan"] if names == "torchtitan" else [])
    error = _refused(capsys, "ckpt", "reshard", run, "--to", "tp=2", "--run", "copy", "--local", "--store", store)
    assert "saved by rayshard.checkpoint without a model description" in error and "--model PRESET" in error
    assert Store(store).committed_steps("copy") == []

    copy = f"copy-{names}"
    assert _cli(capsys, "ckpt", "reshard", run, "--to", "tp=2", "--run", copy, "--local", "--store", store, "--quiet",
                *model)[0] == 0
    assert digests(Store(store).resolve(copy).url) == digests(source)  # weights and both moments, bit for bit
    code, out, _ = _cli(capsys, "ckpt", "diff", f"src@{STEP}", f"{copy}@{STEP}", "--store", store, "--quiet")
    assert code == 0 and out[-1].endswith("the checkpoints hold the same training state")
    # The copy records its model under rayshard's names: the tools need no flag on it.
    assert _cli(capsys, "ckpt", "plan", f"{copy}@{STEP}", "--to", "fsdp=2", "--store", store)[0] == 0

    ours, theirs = str(tmp_path / "hf-src"), str(tmp_path / "hf-api")
    assert _cli(capsys, "ckpt", "export", f"src@{STEP}", "--out", ours, "--store", store, "--quiet")[0] == 0
    assert _cli(capsys, "ckpt", "export", run, "--out", theirs, "--store", store, "--quiet", *model)[0] == 0
    expected, exported = _hf_tensors(ours), _hf_tensors(theirs)
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)
    assert json.loads(open(f"{theirs}/config.json").read())["model_type"] == "llama"


def test_a_plan_reads_byte_ranges_of_rayshard_names_and_refuses_torchtitans_naming_the_fix(saved, capsys):
    store, _ = saved
    code, out, _ = _cli(capsys, "ckpt", "plan", f"api-rayshard@{STEP}", "--to", "tp=2", "--model", "tiny",
                        "--store", store)
    assert code == 0 and out[0].startswith("reshard plan for") and any("rank" in line for line in out)
    error = _refused(capsys, "ckpt", "plan", f"api-torchtitan@{STEP}", "--to", "tp=2", "--model", "tiny", "--names",
                     "torchtitan", "--store", store)
    assert "torchtitan's names" in error and "Fix: `rayshard ckpt reshard` it" in error


def test_a_model_that_does_not_fit_and_flags_on_a_trainer_checkpoint_are_refused(saved, capsys):
    store, _ = saved
    error = _refused(capsys, "ckpt", "reshard", f"api-rayshard@{STEP}", "--to", "tp=2", "--run", "wrong", "--local",
                     "--model", "small", "--store", store)
    assert "does not hold llama (--model small)" in error and "shape mismatches" in error
    error = _refused(capsys, "ckpt", "reshard", f"api-torchtitan@{STEP}", "--to", "tp=2", "--run", "wrong", "--local",
                     "--model", "tiny", "--store", store)  # torchtitan's names read as ours
    assert "missing" in error and "--names" in error
    error = _refused(capsys, "ckpt", "reshard", f"src@{STEP}", "--to", "tp=2", "--run", "wrong", "--local",
                     "--model", "tiny", "--store", store)
    assert "records its own model" in error
    assert Store(store).committed_steps("wrong") == []


def test_a_model_recorded_at_save_needs_no_flag_and_a_wrong_one_is_refused_at_save(saved, tmp_path, capsys):
    store, source = saved
    with capsys.disabled():  # forked ranks dump their stacks to the real stderr if they hang
        reports = _save(source, f"{store}/described", "torchtitan", model={"preset": "tiny", "names": "torchtitan"})
    assert all("error" not in report for report in reports), reports
    _, metadata = read_manifest(reports[0]["url"])
    assert metadata["model_description"]["names"] == "torchtitan"
    assert metadata["model_description"]["model"] == CONFIG.to_dict()
    assert _cli(capsys, "ckpt", "reshard", "described", "--to", "fsdp=2", "--run", "described-copy", "--local",
                "--store", store, "--quiet")[0] == 0
    assert digests(Store(store).resolve("described-copy").url) == digests(source)

    with capsys.disabled():
        reports = _save(source, f"{store}/misdescribed", "torchtitan", model={"preset": "tiny"})  # rayshard names: wrong
    assert all("does not hold llama (preset tiny) under rayshard names" in report["error"] for report in reports), reports
    assert all("\n" not in report["error"] for report in reports)
    assert Store(store).committed_steps("misdescribed") == []


def test_a_dcp_export_is_the_state_dict_as_saved_without_a_model_and_imports_as_the_source(saved, tmp_path, capsys):
    store, source = saved
    out = str(tmp_path / "dcp")
    assert _cli(capsys, "ckpt", "export", f"api-torchtitan@{STEP}", "--format", "dcp", "--out", out, "--workers", "2",
                "--store", store, "--quiet")[0] == 0
    expected = _state_dict(source, "torchtitan")
    loaded = {"model": {k: torch.empty_like(v) for k, v in expected["model"].items()},
              "optim": {"state": {n: {k: torch.empty_like(v) for k, v in s.items()} for n, s in expected["optim"]["state"].items()},
                        "param_groups": [{"lr": 0.0, "params": []}]},
              "rng": torch.zeros(4, dtype=torch.int64), "data": {"next_batch": 0}}
    dcp.load(loaded, checkpoint_id=out, no_dist=True)  # the very state dict structure the loop saved
    for key, tensor in expected["model"].items():
        assert torch.equal(loaded["model"][key], tensor), key
    for name, state in expected["optim"]["state"].items():
        assert all(torch.equal(loaded["optim"]["state"][name][k], v) for k, v in state.items()), name
    assert loaded["optim"]["param_groups"] == expected["optim"]["param_groups"]
    assert torch.equal(loaded["rng"], expected["rng"]) and loaded["data"] == {"next_batch": 7}
    # The DCP import refuses tensors that are not the model's (the loop's `rng` here), naming it.
    error = _refused(capsys, "ckpt", "import", out, "--format", "dcp", "--model", "tiny", "--run", "back", "--store",
                     str(tmp_path / "back"))
    assert "tensor rng [4] has no place" in error
    # Without them, it is torchtitan's Llama under `model.` / `optim.state.`: the import is the source.
    with capsys.disabled():
        reports = _save(source, f"{store}/api-plain", "torchtitan", extras=False)
    assert all("error" not in report for report in reports), reports
    plain, target = str(tmp_path / "dcp-plain"), str(tmp_path / "back")
    assert _cli(capsys, "ckpt", "export", f"api-plain@{STEP}", "--format", "dcp", "--out", plain, "--store", store,
                "--quiet")[0] == 0
    assert _cli(capsys, "ckpt", "import", plain, "--format", "dcp", "--model", "tiny", "--run", "back", "--store", target,
                "--quiet")[0] == 0
    assert digests(Store(target).resolve("back").url) == digests(source)
    # Given the model, the export is torchtitan's layout (model at the top, `optimizer.`), as of the source.
    titan = str(tmp_path / "dcp-titan")
    assert _cli(capsys, "ckpt", "export", f"api-torchtitan@{STEP}", "--format", "dcp", "--out", titan, "--model", "tiny",
                "--names", "torchtitan", "--store", store, "--quiet")[0] == 0
    keys = set(FileSystemReader(titan).read_metadata().state_dict_metadata)
    assert "layers.0.attention.wq.weight" in keys and "optimizer.state.norm.weight.exp_avg" in keys
    assert _cli(capsys, "ckpt", "import", titan, "--format", "dcp", "--model", "tiny", "--run", "titan", "--store", target,
                "--quiet")[0] == 0
    assert digests(Store(target).resolve("titan").url) == digests(source)


def test_ls_verify_digest_and_diff_read_api_checkpoints(saved, capsys):
    store, _ = saved
    code, out, _ = _cli(capsys, "ckpt", "ls", "--store", store)
    assert code == 0 and any(line.split()[:2] == ["api-torchtitan", str(STEP)] for line in out)
    assert _cli(capsys, "ckpt", "verify", f"api-torchtitan@{STEP}", "--deep", "--store", store)[0] == 0
    code, out, _ = _cli(capsys, "ckpt", "digest", f"api-rayshard@{STEP}", "--store", store, "--quiet")
    assert code == 0 and out[-1].startswith("checkpoint digest sha256:")
    # The API's columns are the trainer's (decision 106): the weights and moments compare equal,
    # and what only the loop saved (AdamW's per-parameter steps, its own tensor) is listed.
    code, out, _ = _cli(capsys, "ckpt", "diff", f"src@{STEP}", f"api-rayshard@{STEP}", "--store", store, "--quiet")
    assert code == 1 and all(line.startswith("only in b") for line in out[:-1]), out
    assert {line.split()[3] for line in out[:-1]} == {"step", "tensor"}
    assert out[-1].startswith(f"{3 * len(parameter_shapes(CONFIG))} of ")


def _described(store: str, run: str, model: str) -> str:
    """A checkpoint as rayshard.checkpoint commits one, recording `model` as its description
    (written by the rank save path under our names: a manifest a save could not have checked)."""
    model_, optimizer = trained_model(CONFIG, STEP)
    pending = Store(store).begin(run, STEP)
    rows = save_rank_shard(model_, optimizer, {}, pending.url, pending.file_for(0))
    metadata = {"run": run, "step": STEP, "writer": "rayshard.checkpoint", "layout": {"world_size": 1, "mesh": {}},
                "state": {}, "metadata": None, "model_description": {"model": preset(model).to_dict(), "names": "rayshard"}}
    return pending.commit([Chunk.from_row(row) for row in rows], metadata)


def test_verify_checks_an_api_manifest_against_the_model_it_recorded(saved, capsys):
    store, _ = saved
    _described(store, "recorded-tiny", "tiny")
    _described(store, "recorded-small", "small")
    assert _cli(capsys, "ckpt", "verify", f"recorded-tiny@{STEP}", "--store", store)[0] == 0
    code, out, err = _cli(capsys, "ckpt", "verify", f"recorded-small@{STEP}", "--store", store)
    text = " ".join(out + err)
    assert code != 0 and "does not hold llama (recorded at save)" in text and "shape mismatches" in text
    # The recorded model is what reshard and export use when no flag is given.
    assert _cli(capsys, "ckpt", "reshard", f"recorded-tiny@{STEP}", "--to", "fsdp=2", "--run", "recorded-copy", "--local",
                "--store", store, "--quiet")[0] == 0


def _train_config(store: str, run: str, steps: int, *extra: str):
    args = build_parser().parse_args(["train", "--store", store, "--run", run, "--steps", str(steps), "--global-batch", "4",
                                      "--seq-len", "32", "--seed", "3", "--model", "tiny", *extra])
    return config_from_args(args)


@pytest.mark.slow  # its reshard is the default suite's; the resume is the DCP import's (test_dcp_interop_distributed)
def test_train_resumes_a_resharded_api_checkpoint_as_its_source(saved, run_training, capsys):
    """`train --resume` refuses an API checkpoint in one line naming `ckpt reshard`; the reshard's
    copy (torchtitan's names -> ours, onto tp=2) then resumes step for step as the source does."""
    store, _ = saved
    with pytest.raises(CheckpointError) as refused:
        checkpoint_model(_train_config(store, "from-api", 5, "--resume", f"api-torchtitan@{STEP}"), f"api-torchtitan@{STEP}")
    assert "\n" not in str(refused.value) and "Fix: `rayshard ckpt reshard` it" in str(refused.value)
    assert _cli(capsys, "ckpt", "reshard", f"api-torchtitan@{STEP}", "--to", "tp=2", "--run", "resumable", "--local",
                "--model", "tiny", "--names", "torchtitan", "--store", store, "--quiet")[0] == 0
    with capsys.disabled():
        from_api = run_training(_train_config(store, "from-api", 5, "--resume", f"resumable@{STEP}", "--tp", "2"))
        direct = run_training(_train_config(store, "direct", 5, "--resume", f"src@{STEP}", "--tp", "2"))
    assert sorted(from_api.losses) == [3, 4, 5]
    assert from_api.losses == direct.losses  # step for step, exactly


def test_ray_actors_reshard_a_torchtitan_named_api_checkpoint(saved, ray_session):
    """The description travels to the Ray workers, each of which reads through the mapping."""
    store, source = saved
    description = ModelDescription(preset("tiny"), "torchtitan", "tiny", "--model tiny")
    # num_cpus=0: the session's rank pool holds every logical CPU; the workers only do I/O here.
    result = reshard_checkpoint(Store(store).resolve(f"api-torchtitan@{STEP}").url, ParallelLayout(fsdp=2, tp=2),
                                Store(store), "ray-copy", workers=2, num_cpus=0, log=lambda *_: None,
                                description=description)
    assert result.workers == 2 and result.ranks == 4
    assert digests(result.url) == digests(source)
