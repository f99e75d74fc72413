"""Checkpoint save and load against torch DCP and raw storage, on the same state and ranks.

Four ranks (torch.multiprocessing + gloo, the same `rayshard.actors.training.trainer.Trainer` the Ray actors run)
train the `small` preset one step on layout A (dp2 x tp2), so params and AdamW moments exist,
then, repeatedly and in rotating order:
- save: rayshard (`save_rank_shard` + manifest), DCP (`dcp.save` with `FileSystemWriter`, the
  same model and optimizer state dict), raw (each rank writes the bytes rayshard's save writes as
  one plain file);
- load on the same layout: rayshard (`load_rank_shard`), DCP (`dcp.load` + `set_state_dict`),
  raw (plain reads of exactly the byte ranges rayshard's load reads, each into its own place in one
  pre-touched buffer), checked (the raw reads plus the checksum of every chunk or part rayshard reads).
Then four fresh ranks on layout B (--layout-b, default fsdp4) load what A saved: rayshard, DCP, raw and checked reads of
exactly the byte ranges rayshard's plan reads. "api" is `rayshard.checkpoint` (issue 38) on DCP's own
state dict (`get_state_dict` of the same model and optimizer, then `set_state_dict` after a load, as
DCP's path does): `save` into a run (writer lease, attempt, create-only manifest, LATEST) and
`load`, on both layouts; its ratios against DCP are printed apart. The API and DCP each save and
load once, untimed, before the repeats (first-call costs: the API's gloo group, DCP's caches). An operation's time is the slowest rank's; the
figure is the median over repeats. Every save syncs its files to disk, as a commit must survive a
power loss (decision 222): DCP with its default `sync_files=True`, raw with an fsync per file, so
every method pays the same disk. Peak RSS above the rank's baseline during each operation is
sampled every 2 ms.

    .venv/bin/python bench/checkpoint.py [--model small] [--repeats 5] [--root /tmp/rayshard-bench-ckpt]
        [--layout-b tp=3] [--object-store]

--object-store: layout B's ranks also load A's checkpoint once from an S3 server (moto, started
here on 127.0.0.1, the server the tests use) and the read amplification of that resharded load
is printed: on object stores short row segments are read as whole rows, so a tp that cuts the
row-parallel weights' rows reads them as bands, once per tp group (docs/decisions.md 146). The
API's checkpoint is loaded from S3 too, read once per replica group and band and by every rank
alone (decision 234): `--layout-b dp=2,tp=2` shows the dp replicas' share of it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from bench.peak_rss import PeakRSS  # noqa: E402
from rayshard.actors.training.device_memory import peak_memory_bytes  # noqa: E402
from rayshard.cluster.catalog.store import step_dirname  # noqa: E402
from rayshard.plans.config import DataConfig, ModelChoice, TrainConfig  # noqa: E402
from rayshard.plans.layout.parallel_layout import ParallelLayout  # noqa: E402

LAYOUT_A = ParallelLayout(dp=2, tp=2)
LAYOUT_B = ParallelLayout(fsdp=4)
MiB = 2**20
LOAD_METHODS = ("rayshard", "dcp", "raw", "checked", "api", "sd")
SAVE_METHODS = ("rayshard", "dcp", "raw", "api")


def _timed(operation):
    """Run on every rank between barriers; (slowest rank's seconds, this rank's extra RSS)."""
    import torch.distributed as dist

    dist.barrier()
    with PeakRSS() as rss:
        started = time.perf_counter()
        operation()
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), rss.above_base


def _our_save(trainer, url: str):
    import fsspec
    import torch.distributed as dist

    from rayshard.plans.checkpoint.manifest.codec import encode_manifest
    from rayshard.actors.checkpoint.save import save_rank_shard
    from rayshard.plans.checkpoint.manifest.codec import MANIFEST
    from rayshard.plans.checkpoint.chunks import Chunk

    rows = save_rank_shard(trainer.model, trainer.optimizer, trainer.coord_map, url, f"attempt-bench/rank-{trainer.rank:05d}.safetensors",
                           trainer.pipeline_copies)
    gathered = [None] * dist.get_world_size() if trainer.rank == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    if trainer.rank == 0:
        chunks = [Chunk.from_row(row) for part in gathered for row in part]
        metadata = {"step": trainer.step, "layout": trainer.layout.to_dict(), "model": trainer.config.model.spec.to_dict()}
        fs, base = fsspec.core.url_to_fs(url)
        fs.pipe_file(f"{base}/{MANIFEST}", encode_manifest(chunks, metadata))


def _dcp_state(trainer):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model_state, "optim": optimizer_state}


def _dcp_save(trainer, path: str):
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(trainer), storage_writer=dcp.FileSystemWriter(path))  # sync_files=True, its default


def _dcp_load(trainer, path: str):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(trainer)
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _api_save(trainer, root: str, repeat: int, run: str = "api"):
    import rayshard.checkpoint as ckpt

    ckpt.save(_dcp_state(trainer), f"{root}/api-store/{run}", step=repeat)


def _api_load(trainer, root: str, repeat: int, run: str = "api"):
    _api_load_from(trainer, f"{root}/api-store/{run}@{repeat}")


def _api_load_from(trainer, what: str):
    import rayshard.checkpoint as ckpt
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(trainer)
    ckpt.load(state, what)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


ASYNC_METHODS = ("api", "api-optimizer", "dcp")


def _async_blocked(trainer, root: str, repeat: int, method: str) -> float:
    """Seconds an async save blocks its caller (slowest rank), state dict included: the API's
    (copied to host before it returns), the API's given the optimizer (whose tensors are copied in
    the background, its next step waiting for the copy), DCP's `async_save` (staged before it
    returns). The save itself is then waited for, untimed."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import rayshard.checkpoint as ckpt

    dist.barrier()
    started = time.perf_counter()
    if method == "dcp":
        future = dcp.async_save(_dcp_state(trainer), storage_writer=dcp.FileSystemWriter(f"{root}/dcp-async-{repeat}"))
    else:
        future = ckpt.async_save(_dcp_state(trainer), f"{root}/api-store/async-{method}", step=repeat,
                                 optimizer=trainer.optimizer if method == "api-optimizer" else None)
    blocked = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    future.result()
    dist.all_reduce(blocked, op=dist.ReduceOp.MAX)
    return float(blocked)


def _time_commits() -> list[float]:
    """Seconds of each commit this process makes (create-only manifest, fsynced; LATEST swap)."""
    from rayshard.cluster.catalog.pending import PendingCheckpoint

    seconds, commit = [], PendingCheckpoint.commit_manifest

    def timed(self, manifest):
        started = time.perf_counter()
        try:
            return commit(self, manifest)
        finally:
            seconds.append(time.perf_counter() - started)

    PendingCheckpoint.commit_manifest = timed
    return seconds


def _state_dict_round(trainer):
    """What DCP's and the API's loads both spend outside the checkpoint: get_state_dict, then
    set_state_dict of what it returned (no read)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(trainer)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _raw_bytes(trainer) -> list[memoryview]:
    from rayshard.actors.checkpoint.save import pieces_to_write

    return [piece.tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data
            for piece in pieces_to_write(trainer.model, trainer.optimizer, trainer.pipeline_copies)]


def _raw_save(trainer, path: str):
    blocks = _raw_bytes(trainer)
    with open(path, "wb") as handle:
        for block in blocks:
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())  # as every save here: on disk, not only in the page cache


def _read_buffer(ranges) -> memoryview:
    """One buffer holding every range at its own place, its pages touched before any timing (as
    rayshard's destination tensors are)."""
    return memoryview(bytearray(b"\1") * sum(end - start for _, start, end, _ in ranges))


def _raw_ranges(ranges, buffer: memoryview):
    """Storage bandwidth: the same ranges read into distinct memory, as any load must place them.
    Not into fresh `bytes` per range: that charged the anchor page faults above malloc's mmap
    threshold only (docs/decisions.md 38). Not into one reused buffer either: the resharded
    load's ranges are at most 1.5 MiB, so a reused buffer stayed in L2 and the anchor never wrote
    its bytes to memory (its CPU was 9 ms a rank against 12 ms placed; decision 45)."""
    at = 0
    for path, start, end, _ in ranges:
        with open(path, "rb", buffering=0) as handle:
            handle.seek(start)
            handle.readinto(buffer[at:at + end - start])
        at += end - start


def _our_load(trainer, url: str) -> dict:
    from rayshard.actors.checkpoint.load import load_rank_shard
    from rayshard.plans.training.model_spec import parameter_shapes

    return load_rank_shard(trainer.model, trainer.optimizer, url, set(parameter_shapes(trainer.config.model.spec)))


def _planned_ranges(trainer, url: str) -> list[tuple[str, int, int, list[tuple[int, int]]]]:
    """The byte ranges rayshard's load on this rank reads (for the raw-read anchors), each with the
    spans inside it that the load checksums: every chunk or part of a chunk (not the headers,
    which are small)."""
    from rayshard.actors.checkpoint.load import load_destinations, read_once_for
    from rayshard.actors.checkpoint.stored import StoredCheckpoint
    from rayshard.plans.checkpoint.reshard import ReadItem

    stored = StoredCheckpoint(url)
    destinations = load_destinations(trainer.model, trainer.optimizer, read_once_for(url)).destinations
    return [(f"{stored.base}/{r.file}", r.byte_start, r.byte_end,
             [(p.byte_start, p.byte_end) for p in r.parts if isinstance(p, ReadItem)])
            for r in stored.plan(destinations).requests]


def _checked_raw_ranges(ranges, buffer: memoryview):
    """The raw anchor plus the verification rayshard's load does and nothing else: the same reads
    into the same places, cut in the load's check blocks, each block of a chunk (whole, or the part
    read) run through the checksum right after it lands. No manifest, no plan, no placement, no
    scattering into rows: what a load costs when it checks what it reads (the figure rayshard's
    own overhead is measured against)."""
    from rayshard.actors.checkpoint.read_executor import CHECK_BLOCK_BYTES
    from rayshard.storage.checksums import RunningChecksum

    at = 0
    for path, start, end, spans in ranges:
        with open(path, "rb", buffering=0) as handle:
            for block in range(start, end, CHECK_BLOCK_BYTES):
                stop = min(end, block + CHECK_BLOCK_BYTES)
                view = buffer[at + block - start:at + stop - start]
                handle.seek(block)
                handle.readinto(view)
                for first, last in spans:
                    if first < stop and last > block:
                        RunningChecksum().update(view[max(first, block) - block:min(last, stop) - block])
        at += end - start


def _rotated(methods, repeat: int):
    """No method always runs first (warm caches)."""
    shift = repeat % len(methods)
    return [*methods[shift:], *methods[:shift]]


def _phase_a(rank, config, port, root, repeats, queue):
    from rayshard.actors.training.trainer import Trainer

    trainer = Trainer(config, rank, f"tcp://127.0.0.1:{port}")
    trainer.train_step()
    commits = _time_commits()  # the API's commit on the first rank, inside its save's time
    # Untimed, once: what a process pays on its first save and load only (the API's gloo group and
    # writer lease, DCP's planner caches, lazy imports), which a loop pays once, not per checkpoint.
    _api_save(trainer, root, 0, run="warm")
    _api_load(trainer, root, 0, run="warm")
    _dcp_save(trainer, f"{root}/dcp-warm")
    _dcp_load(trainer, f"{root}/dcp-warm")
    results = {key: [] for key in (*(f"save/{m}" for m in SAVE_METHODS), *(f"load/{m}" for m in LOAD_METHODS))}
    memory = {key: [] for key in results}
    for repeat in range(repeats):
        for method in _rotated(SAVE_METHODS, repeat):
            where = f"{root}/{method}-{repeat}"
            raw_file = f"{where}/rank-{rank:05d}.raw"
            if method == "raw":
                os.makedirs(where, exist_ok=True)
            save = {"rayshard": lambda: _our_save(trainer, where), "dcp": lambda: _dcp_save(trainer, where),
                    "raw": lambda: _raw_save(trainer, raw_file), "api": lambda: _api_save(trainer, root, repeat)}[method]
            seconds, extra = _timed(save)
            results[f"save/{method}"].append(seconds)
            memory[f"save/{method}"].append(extra)
        ranges = _planned_ranges(trainer, f"{root}/rayshard-{repeat}")
        buffer = _read_buffer(ranges)
        for method in _rotated(LOAD_METHODS, repeat):
            where = f"{root}/{method}-{repeat}"
            load = {"rayshard": lambda: _our_load(trainer, where), "dcp": lambda: _dcp_load(trainer, where),
                    "raw": lambda: _raw_ranges(ranges, buffer), "checked": lambda: _checked_raw_ranges(ranges, buffer),
                    "api": lambda: _api_load(trainer, root, repeat), "sd": lambda: _state_dict_round(trainer)}[method]
            seconds, extra = _timed(load)
            results[f"load/{method}"].append(seconds)
            memory[f"load/{method}"].append(extra)
    results["save/api-commit"] = commits[-repeats:] if rank == 0 else []
    for repeat in range(repeats):
        for method in _rotated(ASYNC_METHODS, repeat):
            results.setdefault(f"async/{method}", []).append(_async_blocked(trainer, root, repeat, method))
    shard_bytes = sum(len(b) for b in _raw_bytes(trainer))
    queue.put((rank, results, memory, shard_bytes, _peak_rss()))
    trainer.shutdown()


def _phase_b(rank, config, port, root, repeats, queue):
    from rayshard.actors.training.trainer import Trainer

    trainer = Trainer(config, rank, f"tcp://127.0.0.1:{port}")
    results = {f"reshard/{method}": [] for method in LOAD_METHODS}
    memory = {key: [] for key in results}
    stats = {}
    _our_load(trainer, f"{root}/rayshard-0")  # untimed: creates the AdamW state every method then fills
    _api_load(trainer, root, 0)  # untimed, as in phase A: first-call costs
    _dcp_load(trainer, f"{root}/dcp-0")
    for repeat in range(repeats):
        ranges = _planned_ranges(trainer, f"{root}/rayshard-{repeat}")
        buffer = _read_buffer(ranges)
        for method in _rotated(LOAD_METHODS, repeat):
            load = {"rayshard": lambda: stats.update(_our_load(trainer, f"{root}/rayshard-{repeat}")),
                    "dcp": lambda: _dcp_load(trainer, f"{root}/dcp-{repeat}"),
                    "raw": lambda: _raw_ranges(ranges, buffer), "checked": lambda: _checked_raw_ranges(ranges, buffer),
                    "api": lambda: _api_load(trainer, root, repeat), "sd": lambda: _state_dict_round(trainer)}[method]
            seconds, extra = _timed(load)
            results[f"reshard/{method}"].append(seconds)
            memory[f"reshard/{method}"].append(extra)
    reads = {"bytes_read": stats.get("bytes_read", 0), "bytes_needed": stats.get("bytes_needed", 0)}
    object_store = os.environ.get(OBJECT_STORE_URL)
    if object_store:  # untimed, once: the bytes are the figure (moto reads a whole object per ranged GET)
        loaded = _our_load(trainer, object_store)
        reads.update({"s3_read": loaded["bytes_read"], "s3_needed": loaded.get("bytes_needed", 0),
                      "s3_received": loaded["bytes_received"]})
        reads["s3_api"] = _api_loads_from_s3(trainer, os.environ[API_OBJECT_STORE_URL])
    queue.put((rank, results, memory, reads, _peak_rss()))
    trainer.shutdown()


OBJECT_STORE_URL = "RAYSHARD_BENCH_OBJECT_STORE_URL"  # where phase B's ranks find the checkpoint on S3
API_OBJECT_STORE_URL = "RAYSHARD_BENCH_API_OBJECT_STORE_URL"  # and the API's checkpoint of repeat 0 (its directory)


def _api_loads_from_s3(trainer, what: str) -> dict:
    """The API's load of `what` from S3 read once per replica group and band (the default on an
    object store, decisions 172 and 234), then by every rank alone (`RAYSHARD_READ_ONCE=0`): the
    bytes its plan reads over all ranks and the slowest rank's seconds, each after one untimed load."""
    import rayshard.checkpoint as ckpt

    def load():
        _api_load_from(trainer, what)

    figures = {}
    for read_once in ("1", "0"):
        os.environ["RAYSHARD_READ_ONCE"] = read_once
        try:
            planned = ckpt.plan(_dcp_state(trainer), what).bytes_read
            load()
            figures[read_once] = (planned, _timed(load)[0])
        finally:
            os.environ.pop("RAYSHARD_READ_ONCE", None)
    return figures


def _upload_to_moto(local_checkpoint: str, api_checkpoint: str | None = None):
    """Start a moto S3 server on 127.0.0.1, copy the checkpoint into a bucket and point this process's
    environment (inherited by the spawned ranks) at it; with `api_checkpoint`, that API
    checkpoint's directory too. Returns (the checkpoint's s3 URL, the server)."""
    import logging

    import fsspec
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update({"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
                       "AWS_ENDPOINT_URL": f"http://{host}:{port}"})
    from rayshard.storage.options import configure

    configure()
    import boto3

    boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1").create_bucket(Bucket="bench")
    fs = fsspec.filesystem("s3")
    fs.put(local_checkpoint, "bench/checkpoint", recursive=True)
    url = "s3://bench/checkpoint"
    os.environ[OBJECT_STORE_URL] = url
    if api_checkpoint is not None:
        fs.put(api_checkpoint, "bench/api-checkpoint", recursive=True)
        os.environ[API_OBJECT_STORE_URL] = "s3://bench/api-checkpoint"
    return url, server


def _peak_rss() -> int:
    # The rank process's peak resident set: since its start in phase B; in phase A since its one
    # training step began (a step resets the mark), which is above what building the model took.
    return peak_memory_bytes(torch.device("cpu"))


def _spawn(phase, config, root, repeats):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.spawn(phase, args=(config, port, root, repeats, queue), nprocs=config.layout.world_size)
    return sorted((queue.get() for _ in range(config.layout.world_size)), key=lambda item: item[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", default="/tmp/rayshard-bench-ckpt")
    parser.add_argument("--layout-b", default="fsdp=4", type=ParallelLayout.parse, metavar="LAYOUT",
                        help="the resharded load's layout (default fsdp=4; tp=4 reads the row-parallel weights' "
                             "column slices, issue 42)")
    parser.add_argument("--object-store", action="store_true",
                        help="layout B also loads A's checkpoint once from an S3 server (moto on 127.0.0.1) and prints "
                             "that resharded load's read amplification")
    args = parser.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    os.makedirs(args.root)
    common = dict(model=ModelChoice.named(args.model), steps=1, global_batch=8, seq_len=64,
                  data=DataConfig(max_bytes=2_000_000))
    config_a = TrainConfig(layout=LAYOUT_A, **common).validate()
    config_b = TrainConfig(layout=args.layout_b, **common).validate()
    phase_a = _spawn(_phase_a, config_a, args.root, args.repeats)
    api_checkpoint = f"{args.root}/api-store/api/checkpoints/{step_dirname(0)}"
    server = _upload_to_moto(f"{args.root}/rayshard-0", api_checkpoint)[1] if args.object_store else None
    try:
        phase_b = _spawn(_phase_b, config_b, args.root, args.repeats)
    finally:
        if server is not None:
            server.stop()

    times = {**phase_a[0][1], **phase_b[0][1]}  # every rank got the same (slowest-rank) times
    medians = {key: statistics.median(values) for key, values in times.items()}
    total_bytes = sum(item[3] for item in phase_a)
    print(f"model {args.model}, {LAYOUT_A.world_size} ranks (gloo, CPU), local store {args.root}, {args.repeats} repeats; "
          f"state {total_bytes / MiB:.1f} MiB written once (params + AdamW moments), every save synced to disk")
    print(f"{'operation':<34}{'rayshard':>10}{'DCP':>10}{'raw':>10}{'checked':>10}{'DCP/ours':>10}{'raw/ours':>10}"
          f"{'chk/ours':>10}")
    for title, key in (("save, dp2 x tp2", "save"), ("load, same layout", "load"), (f"load, resharded to {args.layout_b.describe()}", "reshard")):
        ours, dcp, raw = (medians[f"{key}/{m}"] for m in ("rayshard", "dcp", "raw"))
        checked = medians.get(f"{key}/checked")
        cells = (f"{checked:>9.3f}s", f"{checked / ours:>10.2f}") if checked else (f"{'':>10}", f"{'':>10}")
        print(f"{title:<34}{ours:>9.3f}s{dcp:>9.3f}s{raw:>9.3f}s{cells[0]}{dcp / ours:>10.2f}{raw / ours:>10.2f}{cells[1]}")
    print("  (DCP/ours > 1: rayshard faster than DCP; raw/ours is the fraction of raw bandwidth reached, goal >= 0.8;\n"
          "   checked: the raw reads plus the checksum of everything rayshard verifies, no planning or placement, so\n"
          "   raw/checked is what verification alone costs and chk/ours what is left to rayshard's own work)")
    print("rayshard.checkpoint (the API, on get_state_dict's state dict) against DCP on the same state and ranks:")
    for title, key in (("save, dp2 x tp2", "save"), ("load, same layout", "load"),
                       (f"load, resharded to {args.layout_b.describe()}", "reshard")):
        api, dcp = medians[f"{key}/api"], medians[f"{key}/dcp"]
        goal = "goal >= 2" if key == "save" else "goal >= 6"
        print(f"  {title:<32}API {api:.3f}s  DCP {dcp:.3f}s  DCP/API {dcp / api:5.2f}  ({goal}; trainer path DCP/ours "
              f"{dcp / medians[f'{key}/rayshard']:.2f})")
        if key == "save":
            print(f"  {'':<32}of which its commit on the first rank (create-only manifest with fsync, LATEST swap) "
                  f"{medians['save/api-commit']:.3f}s; the trainer path's row writes its manifest with neither")
        if key != "save":  # both loads include get_state_dict + set_state_dict; without it:
            state_dict = medians[f"{key}/sd"]
            print(f"  {'':<32}of which get/set_state_dict {state_dict:.3f}s; without it DCP/API "
                  f"{(dcp - state_dict) / max(1e-9, api - state_dict):5.2f}")
    blocked = {method: medians[f"async/{method}"] for method in ASYNC_METHODS}
    print(f"  async save, blocked until it returns (state dict included): API {blocked['api']:.3f}s, API given the "
          f"optimizer {blocked['api-optimizer']:.3f}s, DCP {blocked['dcp']:.3f}s  (DCP/API {blocked['dcp'] / blocked['api']:.2f}, "
          f"DCP/API given the optimizer {blocked['dcp'] / blocked['api-optimizer']:.2f})")
    print("  per-repeat seconds (slowest rank), to judge the spread on a shared machine:")
    for key in ("load", "reshard"):
        print(f"    {key:<8}" + "  ".join(f"{m} " + ",".join(f"{t:.3f}" for t in times[f"{key}/{m}"])
                                       for m in ("api", "rayshard", "dcp")))
    read = sum(item[3]["bytes_read"] for item in phase_b)
    needed = sum(item[3]["bytes_needed"] for item in phase_b)
    print(f"resharded load to {args.layout_b.describe()}: rayshard read {read / MiB:.2f} MiB for {needed / MiB:.2f} MiB its "
          f"ranks hold: read amplification {read / max(1, needed):.4f}x (goal <= 1.05; beyond the bytes needed: "
          "safetensors headers checked on partly read files, and row segments read whole where the rest of a row is small)")
    if args.object_store:
        read, needed = (sum(item[3][key] for item in phase_b) for key in ("s3_read", "s3_needed"))
        received = sum(item[3]["s3_received"] for item in phase_b)
        print(f"resharded load to {args.layout_b.describe()} from S3 (moto): rayshard read {read / MiB:.2f} MiB for "
              f"{needed / MiB:.2f} MiB its ranks hold: read amplification {read / max(1, needed):.4f}x (goal <= 1.05; "
              f"{received / MiB:.2f} MiB more handed over between ranks: replicas' pieces and tp groups' column slices)")
        (once, once_s), (alone, alone_s) = phase_b[0][3]["s3_api"]["1"], phase_b[0][3]["s3_api"]["0"]
        print(f"API load onto {args.layout_b.describe()} from S3 (moto), one run each: read once per replica group and "
              f"band {once / MiB:.2f} MiB in {once_s:.3f} s; every rank alone {alone / MiB:.2f} MiB in {alone_s:.3f} s "
              f"(bytes alone / once {alone / max(1, once):.2f}x)")
    print("extra RSS above each rank's baseline during the operation, max over ranks and repeats (MiB):")
    for key in ("save", "load", "reshard"):
        phase = phase_a if key != "reshard" else phase_b
        cells = [f"{m} {max(max(item[2][f'{key}/{m}']) for item in phase) / MiB:7.1f}" for m in ("rayshard", "dcp", "raw", "api")]
        print(f"  {key:<8} " + "   ".join(cells))
    print("peak RSS per rank over the whole run (MiB): layout A " + ", ".join(f"{item[4] / MiB:.0f}" for item in phase_a)
          + "; layout B " + ", ".join(f"{item[4] / MiB:.0f}" for item in phase_b))


if __name__ == "__main__":
    main()
