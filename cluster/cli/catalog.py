"""`rayshard ckpt ls | verify | gc`: the catalog of a store, from the command line."""
from __future__ import annotations

import argparse
import datetime as dt
import json

from cluster.cli.ckpt import add_checkpoint_argument, ckpt_subcommands


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return ""


def _when(unix: float | None) -> str:
    return dt.datetime.fromtimestamp(unix).strftime("%Y-%m-%d %H:%M:%S") if unix else "-"


def run_ls(args: argparse.Namespace) -> int:
    from cluster.storage.catalog import Catalog

    catalog = Catalog(args.store)
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
    if args.all:
        leftovers = catalog.leftovers(args.run)
        for leftover in leftovers:
            print(f"leftover: {leftover.kind} {leftover.path} ({leftover.objects} objects, {_size(leftover.size_bytes)}, "
                  f"last written {_when(leftover.newest_unix)})")
        if not leftovers:
            print("no leftovers")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from cluster.cli.ckpt import reading
    from cluster.cli.progress import byte_bar
    from cluster.checkpoint.verify import verify

    with reading(args) as (_, [ref]), byte_bar(args, "verify", enabled=args.deep) as bar:  # a shallow check reads no data
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
    from cluster.storage.retention import collect
    from cluster.storage.store import Store
    from plans.errors import ConfigError

    if args.keep < 0:
        raise ConfigError("--keep", args.keep, "must be 0 or more", "pass --keep N with N >= 0 (LATEST is always kept)")
    report = collect(Store(args.store), args.keep, run=args.run, grace_s=args.grace, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for url in report.removed_checkpoints:
        print(f"{verb} checkpoint {url}")
    for path in report.removed_leftovers:
        print(f"{verb} leftover {path}")
    for path in report.aborted_uploads:
        print(f"{'would abort' if args.dry_run else 'aborted'} incomplete multipart upload {path}")
    for path in report.removed_leases:
        print(f"{verb} expired lease {path}")
    for what, why in report.kept:
        print(f"kept {what}: {why}")
    print(f"{verb} {len(report.removed_checkpoints)} checkpoint(s), {len(report.removed_leftovers)} leftover(s), "
          f"{len(report.aborted_uploads)} upload(s): {_size(report.freed_bytes)}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    from cluster.cli import progress

    group = ckpt_subcommands(commands)
    ls = group.add_parser("ls", help="runs and their checkpoints: step, layout, size, status, parent",
                          description="List the whole checkpoints of a store (a crashed save never shows up here).")
    ls.add_argument("--store", default="./runs", metavar="URL", help="store URL (default ./runs)")
    ls.add_argument("--run", metavar="NAME", help="only this run")
    ls.add_argument("--all", action="store_true", help="also list leftovers of failed or running saves")
    ls.add_argument("--json", action="store_true", help="one JSON record per checkpoint")
    ls.set_defaults(run_command=run_ls)

    verify = group.add_parser("verify", help="check that a checkpoint's files exist with their sizes (--deep: checksums)")
    add_checkpoint_argument(verify)
    verify.add_argument("--deep", action="store_true", help="read every chunk back and compare its CRC32")
    progress.add_arguments(verify)
    verify.set_defaults(run_command=run_verify)

    gc = group.add_parser("gc", help="keep the newest N checkpoints per run; remove the rest and leftovers",
                          description="Never removes LATEST, checkpoints being read, or anything written within --grace.")
    gc.add_argument("--keep", type=int, required=True, metavar="N", help="checkpoints to keep per run (besides LATEST)")
    gc.add_argument("--store", default="./runs", metavar="URL", help="store URL (default ./runs)")
    gc.add_argument("--run", metavar="NAME", help="only this run")
    gc.add_argument("--grace", type=float, default=3600.0, metavar="SECONDS",
                    help="leave leftovers and uploads younger than this alone (default 3600: saves in progress)")
    gc.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    gc.set_defaults(run_command=run_gc)
