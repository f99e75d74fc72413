"""Run elastic training on a multi-node local Ray cluster while injecting faults.

    python tests/e2e/elastic_scenario.py OUT.json [--small] [--moe] [--azure]

A ray.cluster_utils.Cluster with a head and three worker nodes (2 logical CPUs each, one rank
per CPU) starts the run on 8 ranks. The store is S3: a moto server on 127.0.0.1 behind the
fault-injecting proxy (tests/fault_proxy.py), both in this process. Once checkpoints exist, a
fault injector SIGKILLs a rank actor's process mid-step, then SIGKILLs one mid-save (the proxy
holds every rank's shard upload of step 6 and fires the kill while they are in flight), later
removes a worker node, later adds one back. The controller must resume from LATEST each time on
what remains (and grow at a checkpoint when the node returns); every resume is verified
(`verify_resume`): the loaded state's digests must equal the checkpoint's.
Writes the controller's history, the injected events, the run's metrics and the resume checks
to OUT.json.

--small: the default suite's representative: a head and one worker node (4 ranks), SMALL_STEPS
steps, and one fault, a rank SIGKILLed after the first checkpoint.
--azure: the store is Azure Blob Storage instead: Azurite on 127.0.0.1 behind the same proxy.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import uuid
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.state import list_actors  # noqa: E402

from rayshard.cluster.run.elastic import train_elastic  # noqa: E402
from rayshard.cluster.run.resume_check import resume_checks  # noqa: E402
from rayshard.cluster.catalog.store import Store  # noqa: E402
from rayshard.cluster.ray_connection import ensure_auth_token  # noqa: E402
from rayshard.cluster.run.metrics_sinks import read_metrics  # noqa: E402
from rayshard.plans.config import CheckpointConfig, DataConfig, ModelChoice, OptimizerConfig, TrainConfig  # noqa: E402
from rayshard.plans.elastic import FailurePolicy, ScalingPolicy  # noqa: E402

STEPS, EVERY = 20, 2
SMALL_STEPS = 6
RUN = "elastic"
# Every rank's shard upload of this step's first save is held by the proxy; the kill lands then.
MID_SAVE_STEP = 6


def scenario_config(store: str, steps: int = STEPS, moe: bool = False) -> TrainConfig:
    model = "moe-tiny" if moe else "tiny"
    return TrainConfig(model=ModelChoice.named(model), steps=steps, global_batch=8, seq_len=32, seed=7,
                       optimizer=OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=3),
                       data=DataConfig(max_bytes=1_000_000), store=store, run=RUN,
                       checkpoint=CheckpointConfig(every=EVERY, resume="auto", verify_resume=True))


def latest_step(store: str) -> int:
    return Store(store).latest_step(RUN) or 0


def wait_for_checkpoint(store: str, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while latest_step(store) < step:
        if time.time() > deadline:
            raise TimeoutError(f"no checkpoint at step {step} within {timeout}s")
        time.sleep(0.2)


def rank_actor_pids() -> list[int]:
    # The address is explicit: another Ray instance on the machine must not be asked instead.
    actors = list_actors(address=ray.get_runtime_context().gcs_address, detail=True,
                         filters=[("class_name", "=", "RankActor"), ("state", "=", "ALIVE")])
    return sorted(a.pid for a in actors if a.pid and a.placement_group_id)  # not the pool's warm spares (decision 185)


def start_s3():
    """moto on 127.0.0.1 behind the fault proxy, a fresh bucket, and the environment the Ray
    nodes (started after this) pass on to every rank actor."""
    import boto3
    from moto.server import ThreadedMotoServer

    from tests.fault_proxy import FaultProxy
    from tests.s3_fixtures import TEST_STORAGE_ENV, _serialise_conditional_writes

    _serialise_conditional_writes()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = FaultProxy(host, int(port)).start()
    os.environ.update(TEST_STORAGE_ENV, AWS_ENDPOINT_URL=proxy.url)
    bucket = f"elastic-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=proxy.url, region_name="us-east-1").create_bucket(Bucket=bucket)
    return server, proxy, f"s3://{bucket}/store"


def start_azure(log_path: Path):
    """Azurite on 127.0.0.1 behind the fault proxy (installed from npm on first use, as the tests'
    fixtures do), a fresh container, and the connection string the Ray nodes pass on to every
    rank actor (set when tests.azure_fixtures is imported). Returns (a context that stops
    Azurite, the proxy, the az:// store URL)."""
    import contextlib

    from azure.storage.blob import BlobServiceClient

    from tests import azure_fixtures
    from tests.fault_proxy import FaultProxy
    from tests.s3_fixtures import TEST_STORAGE_ENV

    launcher = azure_fixtures.install_azurite()
    if launcher is None:
        raise SystemExit(f"azure store unavailable: {azure_fixtures.install_azurite.reason}")
    stack = contextlib.ExitStack()
    stack.enter_context(azure_fixtures.running_azurite(launcher, log_path))
    atexit.register(stack.close)  # Azurite is a process of its own: stopped however this one ends
    proxy = FaultProxy("127.0.0.1", azure_fixtures.AZURITE_PORT, listen_port=azure_fixtures.PROXY_PORT).start()
    os.environ.update(TEST_STORAGE_ENV)
    container = f"elastic-{uuid.uuid4().hex[:12]}"
    with BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"]) as service:
        service.create_container(container)
    return stack, proxy, f"az://{container}/store"


def kill_a_rank_mid_save(proxy, store: str, events: list):
    """Arm the proxy: it delays every rank's shard upload of step MID_SAVE_STEP's first save and,
    on the first of them, SIGKILLs a rank actor while all uploads are still in flight."""
    fired = threading.Lock()

    def kill(method, target):
        if not fired.acquire(blocking=False):
            return  # one kill; the other held uploads go on after their delay
        pid = rank_actor_pids()[-1]
        os.kill(pid, signal.SIGKILL)
        events.append({"event": "kill_rank_mid_save", "pid": pid, "request": f"{method} {target}",
                       "after_checkpoint": latest_step(store), "at": time.time()})

    return proxy.add("delay", method="PUT", seconds=1.5, times=8, callback=kill,
                     path=rf"/{RUN}/checkpoints/step-{MID_SAVE_STEP:08d}/attempt-[0-9a-f]+/rank-\d+\.safetensors")


def hold_uploads_until(proxy, step: int, released: threading.Event, limit_s: float = 120.0):
    """Arm the proxy: every shard upload of step's saves waits until `released` is set (or the
    limit passes). A fault injected before the release lands before that checkpoint can
    commit, however fast the steps run, so LATEST at the fault is known without racing."""
    def wait(method, target):
        released.wait(limit_s)

    return proxy.add("delay", method="PUT", seconds=0, times=8, callback=wait,
                     path=rf"/{RUN}/checkpoints/step-{step:08d}/attempt-[0-9a-f]+/rank-\d+\.safetensors")


def inject_faults(cluster: Cluster, workers: list, proxy, store: str, events: list) -> None:
    killed, removed, grown = threading.Event(), threading.Event(), threading.Event()
    # Armed now, so none can miss its save: the kill lands before checkpoint 4, the mid-save
    # kill in checkpoint 6's uploads, the node loss before checkpoint 8, and the growth before
    # checkpoint 12 (after checkpoint 10 is trained on the smaller layout).
    hold_uploads_until(proxy, 4, killed)
    mid_save = kill_a_rank_mid_save(proxy, store, events)
    hold_uploads_until(proxy, MID_SAVE_STEP + EVERY, removed)
    hold_uploads_until(proxy, MID_SAVE_STEP + 3 * EVERY, grown)
    try:
        wait_for_checkpoint(store, 2)
        pid = rank_actor_pids()[-1]  # steps 3-4 run (or step 4's save waits) while this looks
        os.kill(pid, signal.SIGKILL)
        events.append({"event": "kill_rank", "pid": pid, "after_checkpoint": latest_step(store), "at": time.time()})
        killed.set()
        deadline = time.time() + 300
        while not mid_save.injected:
            if time.time() > deadline:
                raise TimeoutError(f"no save of step {MID_SAVE_STEP} within 300 s")
            time.sleep(0.2)
        wait_for_checkpoint(store, MID_SAVE_STEP)
        cluster.remove_node(workers.pop())
        removed_after = latest_step(store)
        events.append({"event": "remove_node", "after_checkpoint": removed_after, "at": time.time()})
        removed.set()
        wait_for_checkpoint(store, removed_after + 2 * EVERY)  # the run goes on on fewer ranks first
        workers.append(cluster.add_node(num_cpus=2, num_gpus=0))
        cluster.wait_for_nodes()
        events.append({"event": "add_node", "after_checkpoint": latest_step(store), "at": time.time()})
        grown.set()
    finally:  # never leave training waiting on a hold
        for event in (killed, removed, grown):
            event.set()


def kill_one_rank(store: str, proxy, events: list) -> None:
    """The small scenario's one fault: a rank SIGKILLed after checkpoint 2, before checkpoint 4."""
    killed = threading.Event()
    hold_uploads_until(proxy, 2 * EVERY, killed)
    try:
        wait_for_checkpoint(store, EVERY)
        pid = rank_actor_pids()[-1]
        os.kill(pid, signal.SIGKILL)
        events.append({"event": "kill_rank", "pid": pid, "after_checkpoint": latest_step(store), "at": time.time()})
    finally:
        killed.set()


def main(out: str, small: bool = False, moe: bool = False, azure: bool = False) -> None:
    """small: a head and one worker node, one rank killed; moe: the MoE model with ep pinned to 2,
    so every layout the recovery picks exchanges tokens between ranks; azure: the store is Azure
    Blob Storage (Azurite) instead of S3 (moto)."""
    # Before the cluster: its nodes inherit the store's environment.
    server, proxy, store = start_azure(Path(out).with_name("azurite.log")) if azure else start_s3()
    ensure_auth_token()  # a fresh machine has no token, and Cluster makes none
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 0})
    workers = [cluster.add_node(num_cpus=2, num_gpus=0) for _ in range(1 if small else 3)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    events: list[dict] = []
    outcome: dict = {}

    def run_training():
        outcome["controller"], outcome["state"] = train_elastic(
            scenario_config(store, SMALL_STEPS if small else STEPS, moe), pinned={"ep": 2} if moe else {},
            scaling=ScalingPolicy(min_ranks=2, max_ranks=4 if small else 8),
            failure=FailurePolicy(max_failures=2 if small else 4, backoff_s=0.5))

    # Training runs in a thread: Cluster.add_node installs signal handlers, so faults are
    # injected from the main thread.
    trainer = threading.Thread(target=run_training, daemon=True)
    trainer.start()
    if small:
        kill_one_rank(store, proxy, events)
    else:
        inject_faults(cluster, workers, proxy, store, events)
    trainer.join(timeout=600)
    controller, state = outcome["controller"], outcome["state"]
    metrics = read_metrics(Store(store), RUN)  # the current timeline: each step once
    Path(out).write_text(json.dumps({
        "store": store,
        "state": state.value,
        "history": [{"state": t.state.value, "detail": t.detail, "at": t.at_wall} for t in controller.history],
        "events": events,
        "metrics": metrics,
        "resume_checks": resume_checks(Store(store), RUN),
        "latest_step": latest_step(store),
    }, indent=1))
    ray.shutdown()
    try:
        cluster.shutdown()
    except AttributeError:  # Ray 2.60's Cluster.shutdown trips over a node removed earlier
        pass
    proxy.stop()
    if azure:
        server.close()
    else:
        server.stop()


if __name__ == "__main__":
    main(sys.argv[1], small="--small" in sys.argv[2:], moe="--moe" in sys.argv[2:], azure="--azure" in sys.argv[2:])
