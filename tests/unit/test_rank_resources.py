"""What each rank asks Ray for, and the one-line failures when the cluster cannot give it (issue 19)."""
from __future__ import annotations

import io
import pickle
from pathlib import Path
from contextlib import redirect_stderr

import pytest

from rayshard.cluster.cli import main as cli_main
from rayshard.plans.config import ResourcesConfig
from rayshard.plans.errors import CheckpointError, ConfigError, StepFailed, from_rank
from rayshard.plans.layout.chooser import Workload, choose_layout
from rayshard.plans.layout.resources import (GRAIN, equal_cpu_share, placement_failure, rank_bundle, ranks_offered)
from rayshard.plans.training.model_spec import preset

CPU_COUNTS = [0.5, 1, 1.5, 2, 3, 4, 6, 7, 8, 12, 16, 24, 31, 32, 48, 64, 96, 128, 1.9999, 2.0001, 10.3]


@pytest.mark.parametrize("cpus", CPU_COUNTS)
def test_equal_shares_always_fit_the_cluster(cpus):
    for ranks in range(1, 257):
        share = equal_cpu_share(cpus, ranks)
        grains = round(share * GRAIN)
        assert abs(share * GRAIN - grains) < 1e-6, (cpus, ranks, share)  # a whole number of Ray's grains
        assert grains * ranks <= round(cpus * GRAIN), (cpus, ranks, share)  # never more than the cluster has
        assert share <= 1.0
        if cpus >= ranks:
            assert share == 1.0
        if round(cpus * GRAIN) >= ranks:  # one grain each fits: every rank gets something
            assert share > 0 and ranks_offered({"CPU": cpus}, rank_bundle({"CPU": cpus}, ranks))[0] >= ranks


def test_every_rank_count_up_to_eight_fits_two_cpus():
    for ranks in range(1, 9):
        bundle = rank_bundle({"CPU": 2.0}, ranks)
        assert bundle["CPU"] * ranks <= 2.0 and "GPU" not in bundle
    assert rank_bundle({"CPU": 2.0}, 3) == {"CPU": 0.6666}  # rounding to 0.67 asked for 2.01 CPUs


def test_explicit_and_gpu_bundles():
    assert rank_bundle({"CPU": 16, "GPU": 8}, 4) == {"CPU": 1.0, "GPU": 1.0}
    assert rank_bundle({"CPU": 16, "GPU": 8}, 4, gpus_per_rank=0) == {"CPU": 1.0}
    assert rank_bundle({"CPU": 2}, 4, cpus_per_rank=1) == {"CPU": 1.0}
    assert rank_bundle({"CPU": 2}, 2, gpus_per_rank=1) == {"CPU": 1.0, "GPU": 1.0}
    assert ranks_offered({"CPU": 2.0}, {"CPU": 1.0}) == (2, "2 CPUs / 1 CPU per rank")


def test_placement_failure_names_request_cluster_and_fix():
    line = placement_failure(3, {"CPU": 1.0}, {"CPU": 0.5}, {"CPU": 2.0}, 60)
    assert "\n" not in line
    assert "3 ranks x {1 CPU} were not granted within 60 s" in line
    assert "CPU 0.5 free of 2" in line and "room for 2 such ranks: 2 CPUs / 1 CPU per rank" in line
    assert "Fix: pass --cpus-per-rank 0.6666" in line
    gpu = placement_failure(2, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 2.0}, {"CPU": 2.0}, 5)
    assert "GPU 0 free of 0" in gpu and "--gpus-per-rank 0" in gpu
    busy = placement_failure(2, {"CPU": 1.0}, {"CPU": 0.0}, {"CPU": 2.0}, 5)
    assert "other jobs" in busy and "--start-timeout" in busy


def test_train_config_validates_resources():
    from tests.conftest import small_config

    with pytest.raises(ConfigError, match="cpus_per_rank"):
        small_config(Path("/tmp"), resources=ResourcesConfig(cpus_per_rank=-1))
    with pytest.raises(ConfigError, match="start_timeout_s"):
        small_config(Path("/tmp"), resources=ResourcesConfig(start_timeout_s=0))
    assert small_config(Path("/tmp"), resources=ResourcesConfig(cpus_per_rank=0.5)).resources.cpus_per_rank == 0.5


def test_pinned_layout_larger_than_the_cluster_names_the_ranks():
    with pytest.raises(ConfigError, match="the pinned dimensions need 4 ranks but only 2 are available"):
        choose_layout(2, preset("tiny"), Workload(8, 32), 64 * 2**30, pinned={"dp": 2, "tp": 2})


def test_elastic_chooser_says_what_the_cluster_offers_and_the_fix(monkeypatch):
    from rayshard.cluster.run import elastic
    from rayshard.cluster.run.elastic import layout_chooser_for
    from tests.conftest import small_config

    # A unit test: the capacity is given, and the CPU share must not come from whatever Ray the
    # test session happens to have started (its state call once hung there, see test_ray_train_example.py).
    monkeypatch.setattr(elastic.ray, "is_initialized", lambda: False)

    choose = layout_chooser_for(small_config(Path("/tmp")), {"dp": 2, "tp": 2}, 64 * 2**30, 8,
                                capacity=lambda: "2 ranks (2 CPUs / 1 CPU per rank)")
    with pytest.raises(ConfigError) as error:
        choose(2)
    message = str(error.value)
    assert "need 4 ranks but the cluster offers 2 ranks (2 CPUs / 1 CPU per rank)" in message
    assert "--cpus-per-rank" in message
    assert choose(4).layout.world_size == 4


def test_config_error_pickles_whole():  # raised on a rank, it crosses to the driver by pickle
    error = pickle.loads(pickle.dumps(ConfigError("f", 1, "bad", "fix it")))
    assert str(error) == "f=1: bad. Fix: fix it" and error.fix == "fix it"


def _main_with(monkeypatch, error, debug=False):
    def raises(args):
        raise error
    monkeypatch.setattr(cli_main, "command_of", lambda args: raises)
    monkeypatch.setenv("RAYSHARD_DEBUG", "1" if debug else "")
    stderr = io.StringIO()
    with redirect_stderr(stderr):
        code = cli_main.main(["ckpt", "ls"])
    return code, stderr.getvalue()


REMOTE = ("Traceback (most recent call last):\n  File \"/a.py\", line 1, in load\n    x()\n"
          "rayshard.plans.errors.CheckpointError: /s/rank-00000.safetensors: checksum mismatch at bytes [8, 16)")


def test_a_rank_error_prints_one_line_prefixed_with_its_rank(monkeypatch):
    error = from_rank(CheckpointError("/s/rank-00000.safetensors: checksum mismatch at bytes [8, 16)"), 1, REMOTE)
    code, err = _main_with(monkeypatch, error)
    assert code == 2 and err == "rayshard: error: rank 1: /s/rank-00000.safetensors: checksum mismatch at bytes [8, 16)\n"
    code, err = _main_with(monkeypatch, error, debug=True)
    assert code == 2 and "Traceback" in err and 'File "/a.py"' in err and err.endswith("bytes [8, 16)\n")


def test_storage_errors_from_ranks_exit_3_without_credentials(monkeypatch):
    error = from_rank(OSError("PUT https://key:secret@host/b/k failed"), 2, "")
    code, err = _main_with(monkeypatch, error)
    assert code == 3 and err.startswith("rayshard: error: rank 2: storage request failed: OSError:")
    assert "secret" not in err and err.count("\n") == 1


def test_step_failed_reports_the_first_user_error_or_a_short_traceback(monkeypatch):
    failed = StepFailed("load", {0: "StepTimeout: ...", 3: "ConfigError: x"}, [], causes={3: ConfigError("x", 1, "bad", "fix")},
                        tracebacks={3: REMOTE})
    code, err = _main_with(monkeypatch, failed)
    assert code == 2 and err == "rayshard: error: rank 3: x=1: bad. Fix: fix\n"
    deep = "Traceback (most recent call last):\n" + "".join(f"  File \"/f{i}.py\", line {i}, in f{i}\n    call()\n"
                                                            for i in range(12)) + "ZeroDivisionError: division by zero"
    failed = StepFailed("train_step", {1: "ZeroDivisionError: division by zero"}, [], tracebacks={1: deep})
    code, err = _main_with(monkeypatch, failed)
    assert code == 1 and "rayshard: training stopped: train_step failed on 1 rank(s)" in err
    assert '"/f11.py"' in err and '"/f9.py"' in err and '"/f3.py"' not in err  # short: the last frames


def test_a_rank_whose_process_died_is_one_line(monkeypatch):
    failed = StepFailed("save_shard", {1: "ActorDiedError: The actor died unexpectedly", 0: "RuntimeError: closed"}, [],
                        dead_ranks=[1], tracebacks={1: REMOTE})
    code, err = _main_with(monkeypatch, failed)
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("rayshard: error: training stopped: rank 1's process died during save_shard (1 other rank(s)")
    assert "Fix: resubmit with --resume auto" in err


def test_a_silent_group_names_the_wait():
    failed = StepFailed("train_step", {}, [0, 1], waited_s=30.0)
    assert "no rank answered within 30 s" in str(failed) and "[0, 1]" in str(failed)
