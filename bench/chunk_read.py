"""Large chunks read back from the local store, against raw reads of the same bytes.

The `small` and `medium` presets store chunks of at most a few tens of MiB, so their loads are
dominated by fixed per-tensor work; real models hold chunks of hundreds of MiB (a 405B model's
embedding under tp8 is 1 GiB a rank), where bandwidth decides. One process writes a float32
tensor of --mib MiB and measures, alternating --repeats times with a raw read of the same byte
ranges into an existing buffer:
- same layout: the tensor stored as one chunk, read whole into an existing tensor (every byte
  checked against its CRC32);
- resharded: the tensor stored as two column halves (as tp2 writes a row-parallel weight), the
  first half of its rows read into a row shard (as fsdp2 holds it): each half's rows are one
  contiguous range, scattered row by row into place, checksummed as parts of their chunks and
  combined, as a load's driver does with every rank's parts (here the other rank's half is
  taken as read, so the check is the combine, not a false alarm).
Prints medians and raw/ours (the fraction of raw bandwidth reached; goal >= 0.8).

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

from rayshard.actors.checkpoint.read_executor import fill_from_reads  # noqa: E402

from rayshard.actors.checkpoint.shard_writer import Piece, write_shard  # noqa: E402
from rayshard.storage.checksums import running_like  # noqa: E402
from rayshard.storage.partial_reads import PartialRead, check_partial_reads  # noqa: E402
from rayshard.plans.checkpoint.reshard import plan_reads  # noqa: E402

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
    half = COLUMNS // 2
    whole = write_shard(fs, args.root, "whole.safetensors", [Piece("w", "param", written, (rows, COLUMNS), (0, 0))])
    halves = write_shard(fs, args.root, "halves.safetensors",
                         [Piece("w", "param", written[:, :half].contiguous(), (rows, COLUMNS), (0, 0)),
                          Piece("w", "param", written[:, half:].contiguous(), (rows, COLUMNS), (0, half))])
    print(f"a {args.mib} MiB float32 tensor, local store (page cache), {args.repeats} repeats:")
    for title, chunks, target_rows in (("same layout, one chunk read whole, verified", whole, rows),
                                       ("resharded, column halves into a row shard", halves, rows // 2)):
        items = plan_reads(chunks, (0, 0), (target_rows, COLUMNS))
        target = torch.empty(target_rows, COLUMNS)
        ours_s, raw_s = _measure(fs, args.root, items, target, args.repeats)
        assert torch.equal(target, written[:target_rows]), f"{title}: the read is not bit-exact"
        print(f"  {title:<46} rayshard {ours_s * 1000:6.1f} ms, raw {raw_s * 1000:6.1f} ms, raw/ours {raw_s / ours_s:.2f} "
              "(goal >= 0.8)")
    shutil.rmtree(args.root, ignore_errors=True)


def _measure(fs, root: str, items, target: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Median seconds of rayshard's planned read into `target` and of raw reads of the same byte
    ranges into one buffer of the same size (both touched before timing)."""
    buffer = memoryview(bytearray(b"\1") * sum(item.nbytes for item in items))
    path = f"{root}/{items[0].file}"

    others = _other_parts(root, items)

    def ours():
        parts: list = []
        fill_from_reads(fs, root, items, target, (0, 0), partial=parts)
        if parts:  # the load's driver combines every rank's parts of each chunk
            outcome = check_partial_reads(parts + others)
            assert outcome.verified == len({(p.file, p.chunk_start) for p in parts}) and not outcome.mismatched

    def raw():
        with open(path, "rb", buffering=0) as handle:
            at = 0
            for item in items:
                handle.seek(item.byte_start)
                handle.readinto(buffer[at:at + item.nbytes])
                at += item.nbytes

    times = {"ours": [], "raw": []}
    for repeat in range(repeats):
        for name, operation in (("ours", ours), ("raw", raw))[::1 if repeat % 2 else -1]:
            started = time.perf_counter()
            operation()
            times[name].append(time.perf_counter() - started)
    return statistics.median(times["ours"]), statistics.median(times["raw"])


def _other_parts(root: str, items) -> list:
    """What the other target ranks would report for the rest of each chunk read in part (read
    here once, untimed), so the timed check is the real combine over a whole chunk."""
    others = []
    for chunk, start, end in ((item.chunk, s, e) for item in items
                              for s, e in ((item.chunk.byte_start, item.byte_start), (item.byte_end, item.chunk.byte_end))):
        if start < end:
            with open(f"{root}/{chunk.file}", "rb") as handle:
                handle.seek(start)
                value = running_like(chunk.checksum).update(handle.read(end - start)).value
            others.append(PartialRead(chunk.name, chunk.kind, chunk.file, chunk.byte_start, chunk.byte_end, chunk.checksum,
                                      start, end, value))
    return others


if __name__ == "__main__":
    main()
