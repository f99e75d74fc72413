"""One large chunk read back from the local store, verified, against a raw read of the same bytes.

The `small` and `medium` presets store chunks of at most a few tens of MiB, which stay in cache
between the read and the checksum; real models hold chunks of hundreds of MiB (a 405B model's
embedding under tp8 is 1 GiB a rank). One process writes a float32 tensor of --mib MiB as one
chunk, then alternates, --repeats times: rayshard's planned read into an existing tensor (with
its CRC32C check) and a raw read of the same byte range into an existing buffer. Prints medians
and raw/ours (the fraction of raw bandwidth reached; goal >= 0.8).

    .venv/bin/python bench/chunk_read.py [--mib 400] [--repeats 7] [--root /tmp/rayshard-bench-chunk]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsspec  # noqa: E402
import torch  # noqa: E402

from actors.checkpoint_io import fill_from_reads, write_shard  # noqa: E402
from plans.reshard import plan_reads  # noqa: E402

COLUMNS = 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--root", default="/tmp/rayshard-bench-chunk")
    args = parser.parse_args()
    shutil.rmtree(args.root, ignore_errors=True)
    fs = fsspec.filesystem("file")
    rows = args.mib * 2**20 // (COLUMNS * 4)
    written = torch.randn(rows, COLUMNS)
    chunks = write_shard(fs, args.root, "rank-00000.safetensors", [("w", "param", written, (rows, COLUMNS), (0, 0))])
    items = plan_reads(chunks, (0, 0), (rows, COLUMNS))
    target, buffer = torch.empty(rows, COLUMNS), bytearray(b"\1") * (rows * COLUMNS * 4)  # both touched before timing
    path, start = f"{args.root}/rank-00000.safetensors", chunks[0].byte_start

    def ours():
        fill_from_reads(fs, args.root, items, target, (0, 0))

    def raw():
        with open(path, "rb", buffering=0) as handle:
            handle.seek(start)
            handle.readinto(buffer)

    times = {"ours": [], "raw": []}
    for repeat in range(args.repeats):
        for name, operation in (("ours", ours), ("raw", raw))[::1 if repeat % 2 else -1]:
            started = time.perf_counter()
            operation()
            times[name].append(time.perf_counter() - started)
    assert torch.equal(target, written)
    ours_s, raw_s = statistics.median(times["ours"]), statistics.median(times["raw"])
    print(f"one {args.mib} MiB float32 chunk, local store (page cache), {args.repeats} repeats: "
          f"rayshard {ours_s * 1000:.1f} ms (verified), raw {raw_s * 1000:.1f} ms, raw/ours {raw_s / ours_s:.2f} (goal >= 0.8)")
    shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
