"""`rayshard ckpt plan | reshard | digest | diff | export | import | plot-resume`."""
from __future__ import annotations

import argparse
import json

import fsspec

from rayshard.actors.checkpoint.load import read_once_for
from rayshard.actors.checkpoint.stored import min_segment_bytes_for
from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.checkpoint.digest import checkpoint_digest, diff_checkpoints, digest_checkpoint
from rayshard.cluster.checkpoint.hf_generate import generate_text  # imports transformers only when it runs
from rayshard.cluster.checkpoint.hf_interop import export_hf, import_hf
from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint, target_partition
from rayshard.cluster.checkpoint.reshard_report import build_plan, format_plan
from rayshard.cluster.cli.commands.checkpoint_refs import reading, resolve_checkpoint
from rayshard.cluster.pictures.resume_plot import plot_resume
from rayshard.cluster.progress import byte_bar
from rayshard.cluster.catalog.store import Store
from rayshard.plans.layout.parallel_layout import ParallelLayout


def _layout(text: str):
    return ParallelLayout.parse(text)


def _stage_layout(counts: tuple[int, ...] | None):
    return list(counts) if counts else None


def run_plan(args: argparse.Namespace) -> int:
    ref = resolve_checkpoint(args)  # a dry run reads the manifest only: no lease
    chunks, metadata = read_manifest(ref.url)
    layout = _layout(args.to)
    partition = target_partition(metadata, layout, args.schedule, _stage_layout(args.stage_layout))
    min_segment = (min_segment_bytes_for(fsspec.core.url_to_fs(ref.url)[0]) if args.min_segment_kib is None
                   else int(args.min_segment_kib * 1024))  # what the load from this store would do
    plan, seconds = build_plan(chunks, metadata, layout, partition, min_segment, read_once_for(ref.url))
    for line in format_plan(plan, layout, ref.url, metadata, seconds, len(chunks.file_names()), args.show_ranks):
        print(line)
    return 0


def run_reshard(args: argparse.Namespace) -> int:
    with reading(args) as (store, [ref]), byte_bar(args, "reshard") as bar:
        reshard_checkpoint(ref.url, _layout(args.to), store, args.run, workers=args.workers,
                           num_cpus=args.cpus_per_worker, local=args.local, schedule=args.schedule,
                           stage_layout=_stage_layout(args.stage_layout), log=bar.write, progress=bar)
    return 0


def run_digest(args: argparse.Namespace) -> int:
    with reading(args) as (_, [ref]), byte_bar(args, "digest") as bar:
        digests = digest_checkpoint(ref.url, block_bytes=int(args.block_mib * 2**20), progress=bar)
    if args.json:
        print(json.dumps({"checkpoint": ref.url, "digest": checkpoint_digest(digests),
                          "tensors": [d.__dict__ | {"shape": list(d.shape)} for d in digests]}, indent=2))
        return 0
    for digest in digests:
        print(digest.line())
    print(f"checkpoint digest {checkpoint_digest(digests)}  ({len(digests)} tensors, layout-independent)")
    return 0


def run_diff(args: argparse.Namespace) -> int:
    with reading(args, "a", "b") as (_, [a, b]), byte_bar(args, "diff") as bar:
        differences = diff_checkpoints(a.url, b.url, progress=bar)
    unequal = [d for d in differences if d.status != "equal"]
    for difference in (differences if args.all else unequal):
        print(f"{difference.status:<18} {difference.kind:<10} {difference.name}  {difference.detail}".rstrip())
    print(f"{len(differences) - len(unequal)} of {len(differences)} tensors equal"
          + ("" if unequal else ": the checkpoints hold the same training state"))
    return 1 if unequal else 0


def run_export(args: argparse.Namespace) -> int:
    with reading(args) as (_, [ref]), byte_bar(args, "export") as bar:
        export_hf(ref.url, args.out, dtype=args.dtype, max_shard_bytes=int(args.max_shard_mib * 2**20),
                  include_optimizer=not args.no_optimizer, log=bar.write, progress=bar)
    return 0


def run_generate(args: argparse.Namespace) -> int:
    text = generate_text(args.directory, args.prompt, args.max_new_tokens, args.seed)
    print(text.replace("\n", "\\n"))  # one line, whatever the model wrote
    return 0


def run_import(args: argparse.Namespace) -> int:
    with byte_bar(args, "import") as bar:
        import_hf(args.directory, Store(args.store), args.run, dtype=args.dtype, log=bar.write, progress=bar)
    return 0


def run_plot_resume(args: argparse.Namespace) -> int:
    result = plot_resume(Store(args.store), args.run, args.out, reference=args.reference)
    print(f"wrote {result['out']}: " + "; ".join(result["segments"]))
    if args.reference:
        print(f"largest relative difference to {args.reference} over {result['steps_compared']} steps: "
              f"{result['max_relative_difference']:.2e}")
    return 0
