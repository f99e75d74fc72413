"""`rayshard ckpt plan|reshard|digest|diff|export|import|plot-resume` on a real (single-process) checkpoint."""
import json

import pytest

from rayshard.cluster.cli.main import main
from rayshard.cluster.catalog.store import Store
from rayshard.plans.training.model_spec import preset
from tests.unit.checkpoint_factory import write_checkpoint


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("cli") / "store")
    write_checkpoint(url, "one", preset("tiny"))
    return url


def test_plan_prints_per_rank_reads_and_the_coverage_proof_without_moving_data(store, capsys):
    assert main(["ckpt", "plan", "one", "--store", store, "--to", "dp=1,tp=2,pp=2"]) == 0
    out = capsys.readouterr().out
    assert "to tp2 x pp2 (4 ranks)" in out and "pp1 dp0 fsdp0 tp1" in out
    assert "every target element is read exactly once" in out and "no tensor data was read" in out


def test_plan_refuses_a_layout_the_model_cannot_take(store, capsys):
    assert main(["ckpt", "plan", "one", "--store", store, "--to", "tp=4"]) == 2
    assert "tp=4: must divide the number of kv heads (2)" in capsys.readouterr().err


def test_reshard_digest_and_diff(store, capsys):
    assert main(["ckpt", "reshard", "one", "--store", store, "--to", "fsdp=2,tp=2", "--run", "two", "--local"]) == 0
    assert "committed" in capsys.readouterr().out
    assert main(["ckpt", "digest", "one", "--store", store]) == 0
    first = capsys.readouterr().out.splitlines()
    assert main(["ckpt", "digest", "two", "--store", store]) == 0
    second = capsys.readouterr().out.splitlines()
    assert first == second and first[-1].startswith("checkpoint digest sha256:")
    assert main(["ckpt", "diff", "one", "two", "--store", store]) == 0
    assert "the checkpoints hold the same training state" in capsys.readouterr().out


def test_diff_reports_which_tensors_differ_and_by_how_much(tmp_path, capsys):
    url = str(tmp_path / "store")
    write_checkpoint(url, "a", preset("tiny"), seed=0)
    write_checkpoint(url, "b", preset("tiny"), seed=1)
    assert main(["ckpt", "diff", "a", "b", "--store", url]) == 1
    out = capsys.readouterr().out
    assert "different" in out and "elements differ, max |a-b|" in out and "layers.0.attention.qkv.weight" in out


def test_export_and_import(store, tmp_path, capsys):
    assert main(["ckpt", "export", "one", "--store", store, "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert main(["ckpt", "import", str(tmp_path / "hf"), "--store", store, "--run", "back"]) == 0
    assert Store(store).committed_steps("back") == [2]
    assert main(["ckpt", "diff", "one", "back", "--store", store]) == 0


def test_plot_resume_draws_segments_per_layout(tmp_path, capsys):
    store = Store(str(tmp_path / "store"))
    lines = [{"step": s, "loss": 5.0 - 0.1 * s, "layout": "dp=2,fsdp=1,tp=2,pp=1,vpp=1" if s <= 3 else "dp=1,fsdp=1,tp=2,pp=1,vpp=1"}
             for s in range(1, 7)]
    store.write_text("r/metrics.jsonl", "\n".join(json.dumps(line) for line in lines) + "\n")
    store.write_text("ref/metrics.jsonl", "\n".join(json.dumps(dict(line, layout="dp=2,fsdp=1,tp=2,pp=1,vpp=1")) for line in lines))
    out = tmp_path / "resume.png"
    assert main(["ckpt", "plot-resume", "--store", str(tmp_path / "store"), "--run", "r", "--reference", "ref",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "r: dp2 x tp2 (steps 1-3)" in printed and "r: tp2 (steps 4-6)" in printed and "0.00e+00" in printed
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_long_commands_draw_a_byte_progress_bar_on_stderr(store, tmp_path, capsys):
    commands = {"export": ["export", "one", "--out", str(tmp_path / "hf")],
                "import": ["import", str(tmp_path / "hf"), "--run", "bar-import"],
                "reshard": ["reshard", "one", "--to", "tp=2", "--run", "bar-reshard", "--local"],
                "digest": ["digest", "one"],
                "verify": ["verify", "one", "--deep"],
                "diff": ["diff", "one", "bar-import"]}  # import(export(one)) holds one's state
    for desc, command in commands.items():
        assert main(["ckpt", *command, "--store", store, "--progress"]) == 0
        captured = capsys.readouterr()
        assert f"{desc}: 100%|" in captured.err, (desc, captured.err)
        assert "100%" not in captured.out  # the bar never mixes into the command's output
    # Not a terminal (as here) without --progress, or with --quiet: no bar.
    assert main(["ckpt", "digest", "one", "--store", store]) == 0
    assert main(["ckpt", "digest", "one", "--store", store, "--quiet"]) == 0
    assert "digest:" not in capsys.readouterr().err


def test_cli_failure_classes(monkeypatch, capsys):
    """Storage failures get one line (secrets in endpoint URLs masked); Ray's own errors and a
    closed pipe are not dressed up as storage failures."""
    import rayshard.cluster.cli.main as cli
    from ray.exceptions import GetTimeoutError

    def command_raising(error):
        monkeypatch.setattr(cli, "build_parser", lambda: _ParserRunning(error))

    command_raising(OSError('Could not connect to the endpoint URL: "http://key:se/cret@127.0.0.1:9/b"'))
    assert cli.main([]) == 3
    err = capsys.readouterr().err
    assert "rayshard: error: storage request failed: OSError" in err and "se/cret" not in err and "http://***@127.0.0.1" in err
    command_raising(GetTimeoutError("Get timed out: some object(s) not ready."))
    with pytest.raises(GetTimeoutError):  # a TimeoutError (so an OSError) too, but Ray's to explain
        cli.main([])
    monkeypatch.setattr(cli.os, "dup2", lambda *args: None)  # keep pytest's stdout
    command_raising(BrokenPipeError(32, "Broken pipe"))
    assert cli.main([]) == 141 and "storage" not in capsys.readouterr().err


class _ParserRunning:
    def __init__(self, error):
        self.error = error

    def parse_args(self, argv):
        import argparse

        def run(_):
            raise self.error

        return argparse.Namespace(run_command=run)


def test_offline_reshard_workers_are_capped_to_what_the_ray_cluster_holds():
    """Ray queues an actor that does not fit until CPUs free up: four 1-CPU workers on a 2-CPU
    cluster waited forever. Fewer workers each play more ranks; none that fit is an error."""
    from rayshard.cluster.checkpoint.offline_reshard import _workers_that_fit
    from rayshard.plans.errors import CheckpointError

    said = []
    assert _workers_that_fit(4, 1.0, 2.0, said.append) == 2 and "2 CPUs: 2 worker(s)" in said[0]
    assert _workers_that_fit(4, 0.5, 2.0, said.append) == 4 and len(said) == 1
    assert _workers_that_fit(8, 0.0, 2.0, said.append) == 8  # no CPUs reserved: anything fits
    with pytest.raises(CheckpointError, match="fewer than one worker's --cpus-per-worker 4. Fix: lower"):
        _workers_that_fit(2, 4.0, 2.0, said.append)
    # Asked for by number: kept, for an autoscaling cluster to grow into, and said.
    assert _workers_that_fit(4, 1.0, 2.0, said.append, asked=True) == 4 and "start as it grows" in said[-1]


@pytest.mark.parametrize("argv", [["ckpt", "import", "{url}", "--run", "r"], ["ckpt", "import", "{url}", "--run", "r",
                                   "--format", "dcp", "--model", "tiny"], ["ckpt", "export", "r@1", "--out", "{url}"]])
def test_an_import_source_or_export_target_with_credentials_is_refused_unechoed(argv, tmp_path, capsys):
    """Import records its source URL in the checkpoint and a DCP export names its target in
    .metadata: a URL carrying credentials would put them on disk, where no redaction reaches."""
    secret = "wJalrXUtn/FEMI+K7MDENG=bPxRfiCY"
    url = f"s3://AKIAEXAMPLE:{secret}@bucket/dir"
    assert main([part.replace("{url}", url) for part in argv] + ["--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot carry credentials" in err and secret not in err and "AKIAEXAMPLE" not in err
    assert not (tmp_path / "store" / "r").exists()


def test_diff_compares_bit_for_bit_a_nan_equals_itself_and_minus_zero_differs(tmp_path, capsys):
    import torch

    import rayshard.checkpoint as ckpt

    values = torch.linspace(-3, 5, 32)
    values[0] = float("nan")
    nudged = values.clone()
    nudged[3] = torch.nextafter(nudged[3], torch.tensor(10.0))  # one ulp
    store = str(tmp_path / "store")
    ckpt.save({"model": {"w": values, "z": torch.zeros(5)}}, f"{store}/a", step=1)
    ckpt.save({"model": {"w": nudged, "z": -torch.zeros(5)}}, f"{store}/b", step=1)
    assert main(["ckpt", "diff", "a", "b", "--store", store]) == 1
    out = capsys.readouterr().out
    gap = float((nudged[3].double() - values[3].double()).abs())
    assert f"1 of 32 elements differ, max |a-b| = {gap:.3g}" in out  # the shared NaN is equal, the ulp shows
    assert "5 of 5 elements differ, max |a-b| = 0" in out  # -0.0 is not 0.0, bit for bit
