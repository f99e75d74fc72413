"""Checkpoint I/O against the raw fsspec client on an object store at 127.0.0.1, and async save's
training stall.

Starts the store's server in its own process (so the server does not share this driver's GIL):
moto's S3 server (`--store s3`, the default) or Azurite, the Azure Storage emulator (`--store az`,
installed from npm into build/azurite on first use, as the tests do); then 4 rank actors training
the `small` preset, and alternates, for each repeat:

  save   rayshard's synchronous save (stream shards with parallel multipart or staged blocks, commit
         the manifest)
  put    raw s3fs / adlfs `pipe_file` of the very same shard bytes, one object per rank, from the
         same actors (adlfs's own AzureBlobFileSystem, none of rayshard's settings)
  load   rayshard's load of that checkpoint (planned ranged reads)
  get    raw s3fs / adlfs `cat_file` of the objects `put` wrote
  async  an async save: training is blocked by the save request, the driver's polls, and any
         wait of an optimizer step for the snapshot copy; copy and upload overlap the next steps

and prints medians and the ratios against the anchors measured in the same run:

  save throughput / raw put      goal >= 0.9
  load throughput / raw get      goal >= 0.9
  async blocked / sync save      goal <= 0.05

    .venv/bin/python bench/storage.py [--store s3|az] [--model small] [--dp 2 --tp 2] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BUCKET = "bench"
LOAD_PHASES = ("manifest", "read", "broadcast_after_read")
SERVERS = {"s3": "S3 server moto", "az": "Azure server Azurite"}
RAW = {"s3": "s3fs", "az": "adlfs"}


def start_server(kind: str) -> tuple[subprocess.Popen, int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    if kind == "s3":
        command = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    else:
        from tests.azure_fixtures import install_azurite

        launcher = install_azurite()
        if launcher is None:
            raise SystemExit(f"bench/storage.py --store az: {install_azurite.reason}")
        command = [launcher, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--inMemoryPersistence",
                   "--skipApiVersionCheck", "--disableTelemetry", "--silent"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        with socket.socket() as client:
            if client.connect_ex(("127.0.0.1", port)) == 0:
                return server, port
        time.sleep(0.2)
    server.kill()
    raise RuntimeError(f"the {kind} server did not start within 60 s")


def _raw_fs(url: str):
    """The client a user would reach for, without rayshard's settings: s3fs, or adlfs's own class
    (rayshard registers a subclass of it for az://)."""
    import fsspec

    if url.startswith("az://"):
        from adlfs import AzureBlobFileSystem

        return AzureBlobFileSystem(), url.removeprefix("az://")
    return fsspec.core.url_to_fs(url)


# ---- the raw s3fs anchor, run inside the rank actors (Ray's __ray_call__) --------------------

def _raw_prepare(actor, source_url: str) -> int:
    import fsspec

    fs, path = fsspec.core.url_to_fs(source_url)
    actor._bench_bytes = fs.cat_file(path)
    return len(actor._bench_bytes)


def _raw_put(actor, url: str) -> None:
    fs, path = _raw_fs(url)
    fs.pipe_file(path, actor._bench_bytes)


def _raw_get(actor, url: str) -> int:
    fs, path = _raw_fs(url)
    return len(fs.cat_file(path))


def _timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=("s3", "az"), default="s3",
                        help="s3: moto's S3 server; az: Azurite, the Azure Storage emulator")
    parser.add_argument("--model", default="small")
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--fsdp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    server, port = start_server(args.store)
    # Before Ray starts, so the rank actors inherit them; fake credentials for the local server
    # (Azurite's development account, whose key is public).
    if args.store == "s3":
        os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                           "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"})
    else:
        from tests.azure_fixtures import connection_string

        os.environ["AZURE_STORAGE_CONNECTION_STRING"] = connection_string(port)
    try:
        run(args)
    finally:
        server.kill()


def run(args) -> None:
    import boto3
    import ray

    from rayshard.cluster.run.async_save import AsyncCheckpointer
    from rayshard.cluster.run.rank_group import RankGroup
    from rayshard.cluster.catalog.store import Store
    from rayshard.cluster.run.train import checkpoint_metadata, save_checkpoint
    from rayshard.plans.config import DataConfig, ModelChoice, TrainConfig
    from rayshard.plans.layout.parallel_layout import ParallelLayout

    if args.store == "s3":
        boto3.client("s3").create_bucket(Bucket=BUCKET)
    else:
        from azure.storage.blob import BlobServiceClient

        with BlobServiceClient.from_connection_string(os.environ["AZURE_STORAGE_CONNECTION_STRING"]) as service:
            service.create_container(BUCKET)
    config = TrainConfig(model=ModelChoice.named(args.model),
                         layout=ParallelLayout(dp=args.dp, fsdp=args.fsdp, tp=args.tp), steps=10_000, global_batch=8,
                         seq_len=args.seq_len, data=DataConfig(max_bytes=2_000_000), store=f"{args.store}://{BUCKET}/store",
                         run="bench").validate()
    world = config.layout.world_size
    ray.init(address="local", num_cpus=world, num_gpus=0, include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    store = Store(config.store)
    group = RankGroup(config)
    group.call("configure_storage", store.storage_conf)
    group.call("train_step")  # AdamW moments exist from the first step: full-size checkpoints
    fingerprint = group.setup_info[0].data_fingerprint
    times = {name: [] for name in ("save", "put", "load", "get", "async", "copy", "step", "step_during")}
    total_bytes = 0
    try:
        for repeat in range(args.repeats):
            step = 1000 + repeat
            started = time.perf_counter()
            url = save_checkpoint(group, store, config, step, None, fingerprint)
            times["save"].append(time.perf_counter() - started)

            from rayshard.storage.manifest_io import manifest_bytes, read_manifest

            chunks, _ = read_manifest(url)
            files = sorted({c.file for c in chunks})
            raw = [f"{config.store}/raw/{repeat}/object-{rank}" for rank in range(world)]
            sources = [f"{url}/{files[rank]}" for rank in range(world)]  # rank-NNNNN files, in rank order
            sizes = ray.get([a.__ray_call__.remote(_raw_prepare, s) for a, s in zip(group.actors, sources)])
            total_bytes = sum(sizes)
            times["put"].append(_timed(lambda: ray.get([a.__ray_call__.remote(_raw_put, u) for a, u in zip(group.actors, raw)])))
            started = time.perf_counter()  # as `rayshard train --resume` loads: the driver reads the manifest once
            phases = [rank["seconds"] for rank in group.call("load", url, ray.put(manifest_bytes(url)))]
            times["load"].append(time.perf_counter() - started)
            for phase in LOAD_PHASES:  # the slowest rank's
                times.setdefault(f"load/{phase}", []).append(max(rank.get(phase, 0.0) for rank in phases))
            times["get"].append(_timed(lambda: ray.get([a.__ray_call__.remote(_raw_get, u) for a, u in zip(group.actors, raw)])))

            committed = []
            saver = AsyncCheckpointer(group, store, config.run, world,
                                      lambda s, p: checkpoint_metadata(config, s, p, fingerprint),
                                      lambda s, u: committed.append(u))
            blocked = _timed(lambda: saver.start(step + 500, None))  # sends the requests, waits for nothing
            steps_during = []
            while not committed:  # training goes on; each poll (and the commit report) blocks it
                steps_during.append(_timed(lambda: group.call("train_step")))
                blocked += _timed(saver.poll)
            # A rank's optimizer step waits if its snapshot copy has not finished: training blocked too.
            waited = max(s.optimizer_wait_seconds for s in saver.last_statuses)
            times["async"].append(blocked + waited)
            times["copy"].append(max(s.copy_seconds for s in saver.last_statuses))
            times["step_during"].append(statistics.median(steps_during))
            times["step"].append(statistics.median(_timed(lambda: group.call("train_step")) for _ in range(2)))
            print(f"repeat {repeat + 1}: save {times['save'][-1]:.2f}s put {times['put'][-1]:.2f}s "
                  f"load {times['load'][-1]:.2f}s get {times['get'][-1]:.2f}s async blocked "
                  f"{times['async'][-1] * 1e3:.0f} ms (optimizer waited {waited * 1e3:.0f} ms; snapshot copy "
                  f"{times['copy'][-1] * 1e3:.0f} ms overlapped; {len(steps_during)} steps until committed)", flush=True)
            store.fs.rm(f"{store.root}/bench/checkpoints", recursive=True)  # the server keeps everything
            store.fs.rm(f"{store.root}/raw", recursive=True)
    finally:
        group.shutdown()
        ray.shutdown()

    median = {name: statistics.median(values) for name, values in times.items()}
    mib = total_bytes / 2**20
    print(f"\nmodel {args.model}, layout {config.layout.describe()} ({world} ranks), {mib:.0f} MiB per checkpoint, "
          f"{SERVERS[args.store]} at 127.0.0.1, {args.repeats} repeats (medians)")
    for name, anchor in (("save", "put"), ("load", "get")):
        print(f"  {name:5s} rayshard {median[name]:6.2f} s ({mib / median[name]:6.1f} MiB/s)   "
              f"raw {RAW[args.store]} {anchor} {median[anchor]:6.2f} s ({mib / median[anchor]:6.1f} MiB/s)   "
              f"ratio {median[anchor] / median[name]:.3f}   (goal >= 0.9)")
    print("  load phases, slowest rank, medians: " + ", ".join(
        f"{phase} {median[f'load/{phase}'] * 1e3:.0f} ms" for phase in LOAD_PHASES)
          + " (the hand-over to replicas runs beside the read; what is left of it after the read)")
    print(f"  async save: training blocked {median['async'] * 1e3:.0f} ms vs sync save {median['save'] * 1e3:.0f} ms   "
          f"ratio {median['async'] / median['save']:.3f}   (goal <= 0.05)")
    print(f"  while an async save uploads, a training step takes {median['step_during']:.2f} s "
          f"(otherwise {median['step']:.2f} s): uploads share the CPUs")

if __name__ == "__main__":
    main()
