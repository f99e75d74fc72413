"""The storage soak: a run trained for a while through a proxy that faults a share of all requests,
its driver or a rank killed with -9 every few minutes, resubmitted as an operator's script would.

    python -m tests.soak.soak OUT.json [--minutes 30] [--kill-every-s 150] [--fault-share 0.22]

A moto S3 server and the fault proxy run in this process, a Ray head in its own (started here,
stopped by its own process id); each driver is `python -m rayshard train --resume auto` joining
it. The proxy faults about `fault-share` of all requests (503 SlowDown, 500, resets before and
after the server handled them, replies cut short), seeded, so the retries, the commit protocol,
the writer lease and the commit-window adoption are all exercised. Every few minutes a rank's
process or the driver is SIGKILLed (alternately); whenever the driver exits, for whatever reason,
the next one is started with the same command. An operator's `ckpt gc --keep 4` runs between
attempts. At the end: `ckpt verify --deep` of every committed checkpoint, the run's metrics (one
record per step), an uninterrupted reference run on a local store over the same steps, and the
counts, written to OUT.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RUN = "soak"
STEPS = 100_000  # never reached: the soak stops on time; the schedule is fixed by decay_steps
CONFIG = {"run": RUN, "steps": STEPS, "global_batch": 8, "seq_len": 32, "seed": 7, "model": {"preset": "tiny"},
          "layout": {"dp": 1, "fsdp": 2, "tp": 1, "pp": 1},
          "optimizer": {"lr": 3.0e-3, "min_lr": 3.0e-4, "warmup_steps": 3, "decay_steps": STEPS},
          "data": {"source": "stdlib", "max_bytes": 1_000_000}, "checkpoint": {"every": 1, "resume": "auto"},
          "resources": {"cpus_per_rank": 0.5}}
FAULTS = (("slowdown", 0.07), ("error500", 0.05), ("reset", 0.04), ("reset_after", 0.03), ("cut_body", 0.03))


def _write_config(path: Path, store: str, steps: int | None = None) -> None:
    import yaml

    config = dict(CONFIG, store=store, **({"steps": steps} if steps else {}))
    path.write_text(yaml.safe_dump(config))


def _accepts(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _stop_head(head: subprocess.Popen) -> None:
    """SIGTERM to `ray start` (it drains the node and stops its children), then its process group."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(head.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        head.wait(timeout=60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(head.pid, signal.SIGKILL)


def _rank_pids(address: str) -> list[int]:
    from ray.util.state import list_actors

    try:
        return [a.pid for a in list_actors(address=address, detail=True,
                                           filters=[("class_name", "=", "RankActor"), ("state", "=", "ALIVE")])]
    except Exception:  # the state API not up yet (or busy): the driver is killed instead this time
        return []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every-s", type=float, default=150.0)
    parser.add_argument("--fault-share", type=float, default=0.25)  # of the five kinds together: ~22% of requests
    parser.add_argument("--seed", type=int, default=20261127)
    args = parser.parse_args()

    import boto3
    from moto.server import ThreadedMotoServer

    from tests.fault_proxy import FaultProxy
    from tests.free_port import free_port
    from tests.s3_fixtures import TEST_STORAGE_ENV

    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's line per request would drown the report
    work = Path(tempfile.mkdtemp(prefix="rayshard-soak-"))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    proxy = FaultProxy(host, port).start()
    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    os.environ.update(credentials)
    bucket = f"soak-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=f"http://{host}:{port}", region_name="us-east-1").create_bucket(Bucket=bucket)
    store = f"s3://{bucket}/store"
    env = {**os.environ, **credentials, **TEST_STORAGE_ENV, "AWS_ENDPOINT_URL": proxy.url, "RAY_AUTH_MODE": "token",
           "PYTHONPATH": str(ROOT), "RAYSHARD_S3_MAX_ATTEMPTS": "8"}
    env.pop("RAY_ADDRESS", None)
    os.environ.update(TEST_STORAGE_ENV, AWS_ENDPOINT_URL=proxy.url)  # this process's own checks at the end

    # A Ray head of our own, on free ports, stopped at the end by its own process id and group, nothing else.
    gcs_port, dashboard_port = free_port(), free_port()  # the dashboard serves the state API (rank pids)
    agent_ports = [f"--{flag}={free_port()}" for flag in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port",
        "ray-client-server-port")]
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={gcs_port}",
                             "--num-cpus=2", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
                             f"--dashboard-port={dashboard_port}", *agent_ports, f"--temp-dir={work / 'ray'}",
                             "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work,
                            start_new_session=True)
    address = f"127.0.0.1:{gcs_port}"
    deadline = time.time() + 180
    while not _accepts(gcs_port):
        if time.time() > deadline or head.poll() is not None:
            _stop_head(head)
            raise SystemExit("the soak's Ray head did not start in 180 s")
        time.sleep(1)
    time.sleep(5)  # the raylet registers after the GCS listens
    env["RAY_ADDRESS"] = address

    try:  # whatever happens, the head, the proxy and moto stop with the soak
        config = work / "soak.yaml"
        _write_config(config, store)
        rng = random.Random(args.seed)
        rules = [proxy.add(fault, probability=share * args.fault_share / 0.22, rng=rng) for fault, share in FAULTS]
        events, attempts = [], []
        # The operator's retention, itself through the faulty proxy (checkpoints every step would
        # otherwise fill moto's memory).
        gc_command = [sys.executable, "-m", "rayshard", "ckpt", "gc", "--store", store, "--keep", "4", "--grace", "0"]
        gc, next_gc = None, 0.0
        started = time.time()
        end = started + args.minutes * 60
        next_kill, kill_driver = started + args.kill_every_s, False
        while time.time() < end:
            log = open(work / f"attempt-{len(attempts)}.log", "w")
            driver = subprocess.Popen([sys.executable, "-m", "rayshard", "train", "--config", str(config)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT, cwd=work)
            attempt = {"started": time.time() - started, "pid": driver.pid}
            while driver.poll() is None and time.time() < end:
                if gc is None or gc.poll() is not None:  # retention runs beside training, as a cron job would
                    if time.time() >= next_gc:
                        gc = subprocess.Popen(gc_command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                        next_gc = time.time() + 60
                if time.time() >= next_kill:
                    pids = [] if kill_driver else _rank_pids(f"http://127.0.0.1:{dashboard_port}")
                    victim = driver.pid if kill_driver or not pids else rng.choice(pids)
                    os.kill(victim, signal.SIGKILL)
                    events.append({"at": round(time.time() - started, 1), "kill": "driver" if victim == driver.pid else "rank"})
                    kill_driver, next_kill = not kill_driver, time.time() + args.kill_every_s
                time.sleep(0.5)
            if driver.poll() is None:  # the soak's time is up: the last driver is stopped like the others
                os.kill(driver.pid, signal.SIGKILL)
            driver.wait()
            log.close()
            attempt.update(ended=round(time.time() - started, 1), returncode=driver.returncode,
                           last_line=((work / f"attempt-{len(attempts)}.log").read_text().strip().splitlines() or [""])[-1][:300])
            attempts.append(attempt)
        if gc is not None:
            gc.wait(timeout=600)
        faulted = sum(rule.injected for rule in rules)
        requests = len(proxy.requests)
        proxy.clear()  # the checks below see the store as it is

        from rayshard.cluster.catalog.store import Store
        from rayshard.cluster.checkpoint.verify import verify
        from rayshard.cluster.run.metrics_sinks import read_metrics

        remote = Store(store)
        committed = remote.committed_steps(RUN)
        verified = {step: verify(remote.checkpoint_url(RUN, step), deep=True).ok for step in committed}
        metrics = read_metrics(remote, RUN) or []
        last = max(committed) if committed else 0
        logged = max((r["step"] for r in metrics), default=0)  # steps are logged before their commit
        reference_store = work / "reference"
        reference_config = work / "reference.yaml"
        _write_config(reference_config, str(reference_store), steps=max(last, logged, 1))
        reference_env = {k: v for k, v in env.items() if k != "AWS_ENDPOINT_URL"}
        subprocess.run([sys.executable, "-m", "rayshard", "train", "--config", str(reference_config)], env=reference_env,
                       check=True, capture_output=True, timeout=3600, cwd=work)
        reference = {r["step"]: r["loss"] for r in read_metrics(Store(str(reference_store)), RUN)}
        logged_steps = sum(1 for _ in (remote.read_text(f"{RUN}/metrics.jsonl") or "").splitlines() if '"step"' in _)
        result = {
            "minutes": args.minutes, "requests": requests, "faulted": faulted,
            "faulted_by_kind": {rule.fault: rule.injected for rule in rules},
            "kills": events, "attempts": attempts, "recoveries": max(0, len(attempts) - 1),
            "committed_after_gc": committed, "verified": verified, "last_step": last,
            "metrics_steps": [r["step"] for r in metrics], "steps_logged_in_all": logged_steps,
            "steps_redone": logged_steps - len(metrics),
            "max_relative_loss_difference": max((abs(r["loss"] - reference[r["step"]]) / abs(reference[r["step"]])
                                                 for r in metrics if r["step"] in reference), default=None),
        }
        Path(args.out).write_text(json.dumps(result, indent=1))
    finally:
        _stop_head(head)
        proxy.stop()
        server.stop()
    print(json.dumps({k: v for k, v in result.items() if k not in ("attempts", "metrics_steps", "verified")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
