"""`rayshard ckpt ls | show | verify | gc`: the catalog of a store. Imports no torch."""
from __future__ import annotations

import argparse
import datetime as dt
import json

import numpy as np

from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.checkpoint.verify import verify
from rayshard.cluster.cli.commands.checkpoint_refs import reading, resolve_checkpoint
from rayshard.cluster.progress import byte_bar
from rayshard.cluster.catalog.catalog import Catalog
from rayshard.cluster.catalog.retention import collect
from rayshard.cluster.catalog.snapshot_record import describe_snapshot_record, read_snapshot_record
from rayshard.cluster.catalog.store import Store
from rayshard.plans.errors import ConfigError


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _when(unix: float | None) -> str:
    return dt.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S") if unix else "-"


def run_ls(args: argparse.Namespace) -> int:
    catalog = Catalog(Store(args.store).with_bounded_calls().require_container())
    entries = catalog.checkpoints(args.run)
    if args.json:
        print(json.dumps(catalog.table(args.run).to_pylist(), indent=2))
        return 0
    if not entries:
        runs = catalog.runs()
        where = f"run {args.run!r} in {args.store}" if args.run else args.store
        print(f"no committed checkpoints in {where}" + (f" (runs there: {', '.join(runs)})" if runs and args.run else ""))
    else:
        header = ("RUN", "STEP", "LAYOUT", "SIZE", "STATUS", "CREATED", "PARENT")
        rows = [(e.run, str(e.step) + (" *" if e.latest else ""), e.layout, _size(e.size_bytes),
                 e.status + (f" ({e.readers} reading)" if e.readers else ""), _when(e.created_unix),
                 (e.parent or "-").rsplit("/checkpoints/", 1)[-1] if e.parent and e.parent.startswith(
                     catalog.store.checkpoint_url(e.run, 0).rsplit("/", 1)[0]) else (e.parent or "-"))
                for e in entries]
        widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        print("* = LATEST of its run")
    for run in sorted({e.run for e in entries} | ({args.run} if args.run else set())):
        record = read_snapshot_record(catalog.store, run)  # a run training with --snapshot-every
        if record is not None:
            print(describe_snapshot_record(run, record))
    if args.all:
        leftovers = catalog.leftovers(args.run)
        for leftover in leftovers:
            print(f"leftover: {leftover.kind} {leftover.path} ({leftover.objects} objects, {_size(leftover.size_bytes)}, "
                  f"last written {_when(leftover.newest_unix)})")
        if not leftovers:
            print("no leftovers")
    return 0


def run_show(args: argparse.Namespace) -> int:
    ref = resolve_checkpoint(args)  # reads the manifest only, no shard: no lease
    chunks, metadata = read_manifest(ref.url)
    # Column-wise (a 16k-rank manifest lists 826k chunks; a record each took 5.5 s).
    tensors = len(np.unique(chunks.tensor_keys()))
    files = len(chunks.file_names())
    total = chunks.total_bytes()
    print(f"checkpoint {ref.url}")
    print(f"  run {metadata.get('run')} step {metadata.get('step')}  format {metadata.get('format_version')}")
    print(f"  layout {metadata.get('layout')}  model {metadata.get('model_preset')}")
    print(f"  {tensors} tensors (params and optimizer moments), {len(chunks)} chunks in {files} files, "
          f"{total / 2**20:.2f} MiB")
    print(f"  parent {metadata.get('parent')}")
    if args.json:
        print(json.dumps(metadata, indent=2, sort_keys=True, default=str))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    # A check that only reads runs on a full disk too: without its reader lease, with a warning.
    # A shallow check reads no data: no progress bar.
    with reading(args, lease_optional=True) as (_, [ref]), byte_bar(args, "verify", enabled=args.deep) as bar:
        report = verify(ref.url, deep=args.deep, progress=bar)
    checked = f", {_size(report.bytes_checked)} read back and checksummed" if report.deep else ""
    if report.ok:
        print(f"ok: {ref.url}: {report.files} files and {report.chunks} chunks present with their sizes{checked}")
        return 0
    print(f"FAILED: {ref.url}: {len(report.problems)} problem(s){checked}")
    for problem in report.problems:
        print(f"  {problem}")
    print("Fix: restore the named files, or resume from another checkpoint (`rayshard ckpt ls`).")
    return 1


def run_gc(args: argparse.Namespace) -> int:
    if args.keep < 0:
        raise ConfigError("--keep", args.keep, "must be 0 or more", "pass --keep N with N >= 0 (LATEST is always kept)")
    store = Store(args.store).with_bounded_calls().require_container()
    report = collect(store, args.keep, run=args.run, grace_s=args.grace, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for verdict in report.checkpoints:  # every committed checkpoint, with the rule that decided it
        print(f"{verb if verdict.remove else ('would keep' if args.dry_run else 'kept')} checkpoint "
              f"{verdict.run}@{verdict.step}: {verdict.why} ({verdict.url})")
    for path in report.removed_leftovers:
        print(f"{verb} leftover {path}")
    for path in report.aborted_uploads:
        print(f"{'would abort' if args.dry_run else 'aborted'} incomplete multipart upload {path}")
    for path in report.removed_leases:
        print(f"{verb} expired lease {path}")
    decided = {verdict.url for verdict in report.checkpoints}
    for what, why in report.kept:
        if what not in decided:
            print(f"{'would keep' if args.dry_run else 'kept'} {what}: {why}")
    print(f"{verb} {len(report.removed_checkpoints)} checkpoint(s), {len(report.removed_leftovers)} leftover(s), "
          f"{len(report.aborted_uploads)} upload(s): {_size(report.freed_bytes)}")
    return 0
