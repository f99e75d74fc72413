"""`rayshard ckpt ...`: inspect, verify, reshard and convert checkpoints. Other modules add
subcommands to the same group (`ckpt_subcommands`)."""
from __future__ import annotations

import argparse
import contextlib
import json

from cluster.cli.groups import command_group


def ckpt_subcommands(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:
    return command_group(commands, "ckpt", help="inspect, verify, reshard and convert checkpoints",
                         description="Checkpoints are addressed as RUN[@STEP] within --store, or by URL.")


def add_checkpoint_argument(parser: argparse.ArgumentParser, name: str = "checkpoint", store: bool = True) -> None:
    parser.add_argument(name, metavar=name.upper() if name != "checkpoint" else "CKPT",
                        help="RUN[@STEP] within --store, or a checkpoint directory URL")
    if store:
        parser.add_argument("--store", default="./runs", metavar="URL", help="store holding the run (default ./runs)")


def resolve_checkpoint(args: argparse.Namespace, name: str = "checkpoint"):
    from cluster.storage.store import Store

    return Store(args.store).resolve(getattr(args, name))


@contextlib.contextmanager
def reading(args: argparse.Namespace, *names: str):
    """Resolve the named checkpoint arguments and hold a reader lease on each while the command
    reads its shards (cluster/storage/leases.py), so a concurrent `ckpt gc` keeps them. Yields (store,
    refs). A checkpoint given by URL has no run and step in --store (it may be outside any store)
    and is read without a lease."""
    from cluster.storage import leases
    from cluster.storage.store import Store

    store = Store(args.store)
    with contextlib.ExitStack() as held:
        refs = []
        for name in names or ("checkpoint",):
            ref = store.resolve(getattr(args, name))
            held.enter_context(leases.reading(store, ref))
            refs.append(ref)
        yield store, refs


def _layout(text: str):
    from plans.layout.parallel_layout import ParallelLayout

    return ParallelLayout.parse(text)


def _stage_layout(text: str | None):
    return [int(x) for x in text.split(",")] if text else None


# ---- show ---------------------------------------------------------------------------------------


def run_show(args: argparse.Namespace) -> int:
    from actors.checkpoint.manifest_io import read_manifest

    ref = resolve_checkpoint(args)  # reads the manifest only, no shard: no lease
    chunks, metadata = read_manifest(ref.url)
    tensors = {(c.name, c.kind) for c in chunks}
    files = {c.file for c in chunks}
    total = sum(c.byte_end - c.byte_start for c in chunks)
    print(f"checkpoint {ref.url}")
    print(f"  run {metadata.get('run')} step {metadata.get('step')}  format {metadata.get('format_version')}")
    print(f"  layout {metadata.get('layout')}  model {metadata.get('model_preset')}")
    print(f"  {len(tensors)} tensors (params and optimizer moments), {len(chunks)} chunks in {len(files)} files, "
          f"{total / 2**20:.2f} MiB")
    print(f"  parent {metadata.get('parent')}")
    if args.json:
        print(json.dumps(metadata, indent=2, sort_keys=True, default=str))
    return 0


# ---- plan and reshard ---------------------------------------------------------------------------


def run_plan(args: argparse.Namespace) -> int:
    from actors.checkpoint.load import read_once_for
    from actors.checkpoint.manifest_io import read_manifest
    from cluster.checkpoint.offline_reshard import target_partition
    from cluster.checkpoint.reshard_report import build_plan, format_plan

    ref = resolve_checkpoint(args)  # a dry run reads the manifest only: no lease
    chunks, metadata = read_manifest(ref.url)
    layout = _layout(args.to)
    partition = target_partition(metadata, layout, args.schedule, _stage_layout(args.stage_layout))
    plan, seconds = build_plan(chunks, metadata, layout, partition, int(args.min_segment_kib * 1024), read_once_for(ref.url))
    for line in format_plan(plan, layout, ref.url, metadata, seconds, len({c.file for c in chunks}), args.show_ranks):
        print(line)
    return 0


def run_reshard(args: argparse.Namespace) -> int:
    from cluster.cli.progress import byte_bar
    from cluster.checkpoint.offline_reshard import reshard_checkpoint

    with reading(args) as (store, [ref]), byte_bar(args, "reshard") as bar:
        reshard_checkpoint(ref.url, _layout(args.to), store, args.run, workers=args.workers,
                           num_cpus=args.cpus_per_worker, local=args.local, schedule=args.schedule,
                           stage_layout=_stage_layout(args.stage_layout), log=bar.write, progress=bar)
    return 0


# ---- verification -------------------------------------------------------------------------------


def run_digest(args: argparse.Namespace) -> int:
    from cluster.checkpoint.digest import checkpoint_digest, digest_checkpoint
    from cluster.cli.progress import byte_bar

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
    from cluster.checkpoint.digest import diff_checkpoints
    from cluster.cli.progress import byte_bar

    with reading(args, "a", "b") as (_, [a, b]), byte_bar(args, "diff") as bar:
        differences = diff_checkpoints(a.url, b.url, progress=bar)
    unequal = [d for d in differences if d.status != "equal"]
    for difference in (differences if args.all else unequal):
        print(f"{difference.status:<18} {difference.kind:<10} {difference.name}  {difference.detail}".rstrip())
    print(f"{len(differences) - len(unequal)} of {len(differences)} tensors equal"
          + ("" if unequal else ": the checkpoints hold the same training state"))
    return 1 if unequal else 0


# ---- Hugging Face -------------------------------------------------------------------------------


def run_export(args: argparse.Namespace) -> int:
    from cluster.checkpoint.hf_interop import export_hf
    from cluster.cli.progress import byte_bar

    with reading(args) as (_, [ref]), byte_bar(args, "export") as bar:
        export_hf(ref.url, args.out, dtype=args.dtype, max_shard_bytes=int(args.max_shard_mib * 2**20),
                  include_optimizer=not args.no_optimizer, log=bar.write, progress=bar)
    return 0


def run_import(args: argparse.Namespace) -> int:
    from cluster.checkpoint.hf_interop import import_hf
    from cluster.cli.progress import byte_bar
    from cluster.storage.store import Store

    with byte_bar(args, "import") as bar:
        import_hf(args.directory, Store(args.store), args.run, dtype=args.dtype, log=bar.write, progress=bar)
    return 0


# ---- continuity picture -------------------------------------------------------------------------


def run_plot_resume(args: argparse.Namespace) -> int:
    from cluster.pictures.resume_plot import plot_resume
    from cluster.storage.store import Store

    result = plot_resume(Store(args.store), args.run, args.out, reference=args.reference)
    print(f"wrote {result['out']}: " + "; ".join(result["segments"]))
    if args.reference:
        print(f"largest relative difference to {args.reference} over {result['steps_compared']} steps: "
              f"{result['max_relative_difference']:.2e}")
    return 0


def register(commands: argparse._SubParsersAction) -> None:
    from cluster.cli import progress

    group = ckpt_subcommands(commands)

    show = group.add_parser("show", help="a checkpoint's metadata and size")
    add_checkpoint_argument(show)
    show.add_argument("--json", action="store_true", help="also print the full metadata as JSON")
    show.set_defaults(run_command=run_show)

    plan = group.add_parser("plan", help="dry run: what each rank of another layout would read (no data moved)")
    add_checkpoint_argument(plan)
    _target_arguments(plan)
    plan.add_argument("--min-segment-kib", type=float, default=256, metavar="K",
                      help="read only the needed columns when a row segment is at least K KiB, else whole rows (default 256)")
    plan.add_argument("--show-ranks", type=int, default=16, metavar="N", help="list every rank up to N ranks (default 16)")
    plan.set_defaults(run_command=run_plan)

    reshard = group.add_parser("reshard", help="write a copy laid out for another layout, as a new run (offline, on Ray)")
    add_checkpoint_argument(reshard)
    _target_arguments(reshard)
    reshard.add_argument("--run", required=True, metavar="NAME", help="run name of the copy (same store)")
    reshard.add_argument("--workers", type=int, metavar="N", help="Ray actors playing the target ranks (default one per rank, at most as many as the cluster's CPUs hold)")
    reshard.add_argument("--cpus-per-worker", type=float, default=1.0, metavar="F", help="CPUs each actor reserves (default 1)")
    reshard.add_argument("--local", action="store_true", help="play every rank in this process instead of Ray actors")
    progress.add_arguments(reshard)
    reshard.set_defaults(run_command=run_reshard)

    digest = group.add_parser("digest", help="per-tensor SHA-256 of the global tensors: equal whatever layout wrote them")
    add_checkpoint_argument(digest)
    digest.add_argument("--json", action="store_true")
    digest.add_argument("--block-mib", type=float, default=64, metavar="M", help="rows streamed per read (default 64 MiB)")
    progress.add_arguments(digest)
    digest.set_defaults(run_command=run_digest)

    diff = group.add_parser("diff", help="compare two checkpoints tensor by tensor (exit 1 if they differ)")
    add_checkpoint_argument(diff, "a", store=False)
    add_checkpoint_argument(diff, "b")
    diff.add_argument("--all", action="store_true", help="also list the equal tensors")
    progress.add_arguments(diff)
    diff.set_defaults(run_command=run_diff)

    export = group.add_parser("export", help="write a Hugging Face directory (config.json + safetensors)")
    add_checkpoint_argument(export)
    export.add_argument("--format", choices=["hf"], default="hf")
    export.add_argument("--out", required=True, metavar="DIR")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weights dtype (default: as stored)")
    export.add_argument("--max-shard-mib", type=float, default=2048, metavar="M",
                        help="split into model-0000i-of-0000n.safetensors + index past M MiB (default 2048)")
    export.add_argument("--no-optimizer", action="store_true", help="leave out the optimizer moments (rayshard-optimizer/)")
    progress.add_arguments(export)
    export.set_defaults(run_command=run_export)

    importer = group.add_parser("import", help="make a checkpoint (RUN@STEP) from a Hugging Face Llama directory")
    importer.add_argument("directory", metavar="DIR")
    importer.add_argument("--run", required=True, metavar="NAME")
    importer.add_argument("--store", default="./runs", metavar="URL")
    importer.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="training dtype (default float32)")
    progress.add_arguments(importer)
    importer.set_defaults(run_command=run_import)

    plot = group.add_parser("plot-resume", help="PNG of loss curves: a run on layout A, its resume on layout B, a reference")
    plot.add_argument("--store", default="./runs", metavar="URL")
    plot.add_argument("--run", action="append", required=True, metavar="NAME",
                      help="run(s) to draw; each layout segment gets its own colour (repeatable)")
    plot.add_argument("--reference", metavar="NAME", help="the uninterrupted run to compare with")
    plot.add_argument("--out", default="resume.png", metavar="PNG")
    plot.set_defaults(run_command=run_plot_resume)


def _target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", required=True, metavar="LAYOUT", help="target layout, e.g. dp=1,tp=2,pp=2")
    parser.add_argument("--schedule", metavar="NAME", help="pipeline schedule of the target (decides stage placement)")
    parser.add_argument("--stage-layout", metavar="COUNTS", help="layers per stage, e.g. 1,3 (default: even)")
