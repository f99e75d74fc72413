"""torch DCP import throughput against a raw read of the same `.distcp` bytes, and its peak memory.

A torchtitan-named Llama state of the preset's shapes (weights, AdamW moments and step, random
values) is saved once with `torch.distributed.checkpoint.save` (one process: each tensor one
chunk). Then, repeatedly and in alternating order:
- raw: every `.distcp` file read start to end in 64 MiB `readinto`s into one reused buffer (the
  floor any importer pays to see the bytes);
- copy: the same reads, each block also written to a file in the import's store root (the floor
  of any importer that writes what it reads: not the goal's anchor, shown for scale);
- import: `import_dcp` of the directory into a fresh store (`rayshard ckpt import --format dcp`:
  restricted metadata read, chunk location, row bands through the torchtitan mapping, safetensors
  written with checksums, manifest commit), its bands taken from memory maps of the `.distcp`
  pages (decision 131), each band produced when the writer reaches it;
- a second import for comparison (`--compare`): `read-ahead` (the default), the same with the next
  band produced on a background thread while one is written (decision 195, off by default in the
  importer), or `reads`, bands read into buffers first as before decision 131.
Throughput is the `.distcp` bytes over the wall time of each; the figure is the median over
repeats. The same ratios are also printed by CPU time (the process's, all threads, kernel time
included: what the copies cost, which the wall time of a machine shared with other tenants hides
behind waits for a core; decision 197). Both read from the page cache (the first raw read warms it); the import's store is on
tmpfs by default (`--store-root`), so the figure is the importer's own cost, not a shared disk's
write-back (pass a disk path to include it). Peak RSS above the process's
resident set before the import is sampled every 2 ms; the goal is at most the largest chunk +
256 MiB.

    .venv/bin/python bench/dcp_interop.py [--model small] [--repeats 5] [--root /tmp/rayshard-bench-dcp]
                                          [--store-root /dev/shm/rayshard-bench-dcp-store] [--compare read-ahead|reads]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

from bench.peak_rss import PeakRSS  # noqa: E402
from rayshard.cluster.catalog.store import Store  # noqa: E402
from rayshard.cluster.checkpoint.dcp_import import import_dcp  # noqa: E402
from rayshard.cluster.checkpoint.row_bands import BAND_BYTES  # noqa: E402
from rayshard.plans.interop.torchtitan import torchtitan_mapping  # noqa: E402
from rayshard.plans.training.model_spec import parameter_shapes, preset  # noqa: E402
from rayshard.plans.transforms.mapping import Meta  # noqa: E402

MiB = 2**20
READ_BLOCK = 64 * MiB


def save_dcp(model_name: str, directory: str) -> int:
    """The torchtitan-named state saved by dcp.save; returns the largest tensor's bytes."""
    model = preset(model_name)
    ours = {name: Meta(tuple(shape), "float32") for name, shape in parameter_shapes(model).items()}
    shapes = {name: meta.shape for name, meta in torchtitan_mapping(model).plan(ours).outputs.items()}
    generator = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}
    optimizer = {}
    for name, shape in shapes.items():
        optimizer[f"state.{name}.exp_avg"] = torch.randn(shape, generator=generator)
        optimizer[f"state.{name}.exp_avg_sq"] = torch.rand(shape, generator=generator)
        optimizer[f"state.{name}.step"] = torch.tensor(10.0)
    dcp.save({**weights, "optimizer": optimizer}, checkpoint_id=directory, no_dist=True)
    return max(tensor.numel() * tensor.element_size() for tensor in weights.values())


def distcp_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".distcp"))


CPU: list[tuple[str, float]] = []  # (what, process CPU seconds) of every timed run


def raw_read(files: list[str], buffer: bytearray) -> float:
    view = memoryview(buffer)
    started, cpu = time.perf_counter(), time.process_time()
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(view):
                pass
    CPU.append(("raw", time.process_time() - cpu))
    return time.perf_counter() - started


def raw_copy(files: list[str], buffer: bytearray, target: str) -> float:
    view = memoryview(buffer)
    started, cpu = time.perf_counter(), time.process_time()
    with open(target, "wb", buffering=0) as out:
        for path in files:
            with open(path, "rb", buffering=0) as handle:
                while count := handle.readinto(view):
                    out.write(view[:count])
    seconds = time.perf_counter() - started
    CPU.append(("copy", time.process_time() - cpu))
    os.remove(target)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--root", default="/tmp/rayshard-bench-dcp", help="where the DCP directory is saved")
    parser.add_argument("--store-root", default="/dev/shm/rayshard-bench-dcp-store", help="where the imports are written")
    parser.add_argument("--compare", choices=("read-ahead", "reads"), default="read-ahead",
                        help="the second import timed: with the read-ahead, or without the maps (reads)")
    args = parser.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    directory = os.path.join(args.root, "dcp")
    largest = save_dcp(args.model, directory)
    files = distcp_files(directory)
    total = sum(os.path.getsize(path) for path in files)
    buffer = bytearray(READ_BLOCK)
    raw_read(files, buffer)  # warm the page cache
    CPU.clear()
    raw_times, copy_times, import_times, peaks = [], [], [], []
    read_times, read_peaks = [], []
    os.makedirs(args.store_root, exist_ok=True)
    model = preset(args.model)
    for repeat in range(args.repeats):
        store = os.path.join(args.store_root, f"store-{repeat}")

        def run_import(default=True):
            times, memory = (import_times, peaks) if default else (read_times, read_peaks)
            views = default or args.compare != "reads"
            read_ahead = not default and args.compare == "read-ahead"
            with PeakRSS() as rss:
                started, cpu = time.perf_counter(), time.process_time()
                import_dcp(directory, Store(store), "imported", model, f"--model {args.model}", log=lambda *_: None,
                           views=views, read_ahead=read_ahead)
                times.append(time.perf_counter() - started)
                CPU.append(("import" if default else "compare", time.process_time() - cpu))
            memory.append(rss.above_base)
            shutil.rmtree(store)
        if repeat % 2:
            run_import()
            run_import(default=False)
            copy_times.append(raw_copy(files, buffer, os.path.join(args.store_root, "copy")))
            raw_times.append(raw_read(files, buffer))
        else:
            raw_times.append(raw_read(files, buffer))
            copy_times.append(raw_copy(files, buffer, os.path.join(args.store_root, "copy")))
            run_import(default=False)
            run_import()
    raw, copied, imported = statistics.median(raw_times), statistics.median(copy_times), statistics.median(import_times)
    read_first = statistics.median(read_times)
    print(f"model {args.model}: {len(files)} .distcp file(s), {total / MiB:.1f} MiB; largest chunk {largest / MiB:.1f} MiB; "
          f"band {BAND_BYTES // MiB} MiB; store {args.store_root}; torch {torch.__version__}; median of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.0f} on {os.cpu_count()} CPUs")
    print(f"  raw read      {total / MiB / raw:8.1f} MiB/s  ({raw:.2f} s)")
    print(f"  raw copy      {total / MiB / copied:8.1f} MiB/s  ({copied:.2f} s)")
    print(f"  rayshard import {total / MiB / imported:6.1f} MiB/s  ({imported:.2f} s)  = {raw / imported:.2f}x raw read "
          f"(goal >= 0.8x), {copied / imported:.2f}x raw copy")
    print(f"  import ({args.compare}) {total / MiB / read_first:6.1f} MiB/s  ({read_first:.2f} s)  = {raw / read_first:.2f}x raw "
          f"read, {copied / read_first:.2f}x raw copy; the default import takes {imported / read_first:.2f}x its time")
    cpu = {what: statistics.median(seconds for name, seconds in CPU if name == what)
           for what in ("raw", "copy", "import", "compare")}
    print(f"  by CPU time: raw read {cpu['raw']:.2f} s, raw copy {cpu['copy']:.2f} s, import {cpu['import']:.2f} s = "
          f"{cpu['raw'] / cpu['import']:.2f}x raw read, {cpu['copy'] / cpu['import']:.2f}x raw copy; {args.compare} "
          f"{cpu['compare']:.2f} s = {cpu['raw'] / cpu['compare']:.2f}x, {cpu['copy'] / cpu['compare']:.2f}x")
    print(f"  import peak RSS above base: median {statistics.median(peaks) / MiB:.0f} MiB, max {max(peaks) / MiB:.0f} MiB "
          f"(goal <= largest chunk + 256 MiB = {(largest + 256 * MiB) / MiB:.0f} MiB); {args.compare}: median "
          f"{statistics.median(read_peaks) / MiB:.0f}, max {max(read_peaks) / MiB:.0f} MiB")
    shutil.rmtree(args.root, ignore_errors=True)
    shutil.rmtree(args.store_root, ignore_errors=True)


if __name__ == "__main__":
    main()
