"""One trainer per run: the run's writer lease. A second trainer, started together with the first
or joining late, is refused before its first step in one line naming the holder, and the
winner's metrics.jsonl holds every one of its steps; a holder killed with -9 on this host is seen
dead at once; a lease from elsewhere lapses only when it expires; a trainer whose lease was taken
stops before committing more. Real processes, real local and S3 (moto) stores."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.catalog.writer_lease import RunBusy, WriterLease
from rayshard.cluster.cli.main import main
from rayshard.cluster.run.metrics_sinks import read_metrics
from rayshard.plans.layout.parallel_layout import ParallelLayout
from tests.integration.test_s3_training import _config
from tests.s3_fixtures import TEST_STORAGE_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOLD = ("import sys, time; from rayshard.cluster.catalog.store import Store; "
        "from rayshard.cluster.catalog.writer_lease import holding\n"
        "with holding(Store(sys.argv[1]), 'r', ttl_s=60):\n    print('held', flush=True); time.sleep(600)")


@pytest.fixture(params=["local", "s3"])
def store_url(request, tmp_path):
    return str(tmp_path / "store") if request.param == "local" else request.getfixturevalue("s3_store")


@pytest.fixture
def holder(store_url):
    """Another process holding run 'r''s writer lease (on this host)."""
    process = subprocess.Popen([sys.executable, "-c", HOLD, store_url], stdout=subprocess.PIPE, cwd=ROOT)
    assert process.stdout.readline().strip() == b"held"
    yield process
    if process.poll() is None:
        process.kill()
        process.wait()


def test_a_held_run_refuses_a_second_trainer_in_one_line_and_frees_when_its_holder_dies(store_url, holder, capsys):
    with pytest.raises(RunBusy, match=rf"run 'r' is being trained by pid {holder.pid} on {socket.gethostname()}"):
        WriterLease(Store(store_url), "r", 30).acquire()
    # The CLI: one line, exit 2, before anything starts (no Ray is asked for).
    assert main(["train", "--store", store_url, "--run", "r", "--steps", "1", "--model", "tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"is being trained by pid {holder.pid}" in err[0] and "Fix: " in err[0], err
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    lease = WriterLease(Store(store_url), "r", 30)
    lease.acquire()  # its process is gone from this host: no wait for the expiry
    lease.release()


def _foreign_lease(store: Store, expires_unix: float) -> None:
    record = {"holder": "pid 1 on elsewhere", "host": "elsewhere", "pid": 1, "token": "x", "expires_unix": expires_unix}
    store.backend.make_directory(f"{store.root}/r")
    store.backend.replace(f"{store.root}/r/WRITER", json.dumps(record).encode())


def test_a_lease_from_another_host_holds_until_it_expires(store_url):
    store = Store(store_url)
    _foreign_lease(store, time.time() + 60)
    with pytest.raises(RunBusy, match="being trained by pid 1 on elsewhere"):
        WriterLease(store, "r", 30).acquire()
    _foreign_lease(store, time.time() - 1)
    lease = WriterLease(store, "r", 30)
    lease.acquire()
    assert json.loads(store.backend.read_versioned(f"{store.root}/r/WRITER")[0])["token"] == lease.token
    lease.release()


def test_a_trainer_whose_lease_was_taken_stops_before_committing(store_url):
    store = Store(store_url)
    lease = WriterLease(store, "r", 30)
    lease.acquire()
    _foreign_lease(store, time.time() + 60)  # taken (as after a lapse) by a trainer elsewhere
    lease.renew()
    with pytest.raises(RunBusy, match="lost its writer lease \\(pid 1 on elsewhere took"):
        lease.check()


STEPS = 40  # the winner still trains when the late one joins, after the winner's first commit


def _driver(ray_session, store: str) -> subprocess.Popen:
    env = dict(os.environ, RAY_ADDRESS=ray_session.get_runtime_context().gcs_address, **TEST_STORAGE_ENV)
    spec = {"store": store, "layout": {"fsdp": 2}, "run": "two", "steps": STEPS, "ckpt_every": 4, "resume": "auto"}
    return subprocess.Popen([sys.executable, "-m", "tests.integration.crash_driver", json.dumps(spec)], env=env,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # decision 153: two real drivers racing (40 s); the lease's races are the unit cases above
def test_two_trainers_on_one_run_one_trains_the_others_stop_before_a_step(ray_session, run_training, tmp_path):
    store = str(tmp_path / "store")
    together = [_driver(ray_session, store), _driver(ray_session, store)]
    deadline = time.time() + 300
    while not Store(store).committed_steps("two") and time.time() < deadline:
        assert not all(p.poll() is not None for p in together), [p.stderr.read()[-2000:] for p in together]
        time.sleep(0.1)
    # A third joins late, while the winner trains: refused before it starts a rank.
    late = _config(tmp_path, ParallelLayout(fsdp=2), steps=STEPS, run="two", ckpt_every=4, resume="auto")
    with pytest.raises(RunBusy, match="run 'two' is being trained by pid"):
        run_training(late)
    outputs = [p.communicate(timeout=300) for p in together]
    codes = [p.returncode for p in together]
    assert sorted(codes) == [0, 1], (codes, [err[-2000:] for _, err in outputs])
    _, loser_err = outputs[codes.index(1)]
    assert "RunBusy: run 'two' is being trained by pid" in loser_err, loser_err[-2000:]
    # The winner's metrics: every step once; the loser never trained, so nothing of its is there.
    assert [r["step"] for r in read_metrics(Store(store), "two")] == list(range(1, STEPS + 1))
    assert Store(store).committed_steps("two") == list(range(4, STEPS + 1, 4))


def test_a_renewal_whose_version_was_not_read_back_is_still_ours(store_url):
    """A renewal landed but reading its version back failed (a network error): the next renewal
    meets its own write, recognises its token and renews from there, not 'lost to itself'."""
    lease = WriterLease(Store(store_url), "r", 30)
    lease.acquire()
    lease.renew()
    lease.version = "a version of ours that was never read back"
    lease.renew()
    lease.check()  # still held
    assert lease.lost is None
    lease.release()


def test_a_lease_whose_holder_stopped_renewing_is_waited_out_not_refused(store_url, capfd):
    store = Store(store_url)
    now = time.time()
    record = {"holder": "pid 1 on elsewhere", "host": "elsewhere", "pid": 1, "token": "x",
              "renewed_unix": now - 10, "expires_unix": now + 2}  # a 12 s lease, 10 s without renewal
    store.backend.make_directory(f"{store.root}/r")
    store.backend.replace(f"{store.root}/r/WRITER", json.dumps(record).encode())
    lease = WriterLease(store, "r", 30)
    lease.acquire()
    assert time.time() >= now + 2 and "has not been renewed for 10 s" in capfd.readouterr().err
    lease.release()


def test_a_ranks_marks_survive_the_trip_of_a_config_error():
    import pickle

    from rayshard.plans.errors import ConfigError

    error = ConfigError("f", 1, "must be 2", "set it to 2")
    error.rayshard_raised_unix = 5.0
    assert pickle.loads(pickle.dumps(error)).rayshard_raised_unix == 5.0


def test_offline_writers_into_a_held_run_are_refused_in_one_line(tmp_path, capsys):
    """`ckpt reshard --run` and `ckpt import --run` write into a run as a trainer does: they take
    its writer lease, so one into a run being trained stops at once, naming the holder, and
    writes nothing there."""
    from rayshard.cluster.checkpoint.hf_interop import export_hf
    from rayshard.plans.training.model_spec import preset
    from tests.unit.checkpoint_factory import write_checkpoint

    store_url = str(tmp_path / "store")
    write_checkpoint(store_url, "source", preset("tiny"))
    source = f"{store_url}/source/checkpoints/step-00000002"
    export_hf(source, str(tmp_path / "hf"), log=lambda *_: None)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, store_url], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == b"held"
        commands = [["ckpt", "reshard", source, "--to", "fsdp=2", "--run", "r", "--local", "--store", store_url],
                    ["ckpt", "import", str(tmp_path / "hf"), "--run", "r", "--store", store_url]]
        for command in commands:
            assert main(command) == 2, command
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"is being trained by pid {holder.pid}" in err[0], (command, err)
        assert Store(store_url).committed_steps("r") == []
    finally:
        holder.kill()
        holder.wait()
    # Free again, the same reshard commits (the lease is released after it).
    assert main(commands[0]) == 0
    assert Store(store_url).committed_steps("r") == [2]
    assert WriterLease(Store(store_url), "r", 30)._takeable(json.loads((tmp_path / "store/r/WRITER").read_text()))


def test_a_library_save_waits_out_a_lease_from_another_host_that_lapses(tmp_path, capfd):
    """A training loop restarted by its launcher on another host meets its killed predecessor's
    lease still looking alive: `rayshard.checkpoint` waits for it to lapse (saying so) instead of
    refusing; a trainer (wait_s=0) is still refused at once."""
    store = Store(str(tmp_path / "store"))
    lapses = time.time() + 3
    _foreign_lease(store, lapses)
    with pytest.raises(RunBusy):
        WriterLease(store, "r", 30).acquire()
    lease = WriterLease(store, "r", 30)
    lease.acquire(wait_s=60)
    # Taken only once the other host's lease had lapsed, never over it; and it said it waited.
    assert time.time() >= lapses and "waiting up to 60 s" in capfd.readouterr().err
    assert json.loads(store.backend.read_versioned(f"{store.root}/r/WRITER")[0])["token"] == lease.token
    lease.release()
