"""`rayshard ckpt plan | reshard | digest | diff | export | import | plot-resume`."""
from __future__ import annotations

import argparse
import contextlib
import json

import fsspec

from rayshard.actors.checkpoint.load import read_once_for
from rayshard.actors.checkpoint.stored import min_segment_bytes_for
from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.checkpoint.digest import checkpoint_digest, diff_checkpoints, digest_checkpoint
from rayshard.cluster.checkpoint.hf_generate import generate_text  # imports transformers only when it runs
from rayshard.cluster.checkpoint.dcp_export import export_dcp
from rayshard.cluster.checkpoint.described_source import MappedCheckpoint, is_api_checkpoint, open_source
from rayshard.cluster.checkpoint.dcp_import import import_dcp
from rayshard.cluster.checkpoint.hf_interop import DEFAULT_SHARD_BYTES, export_hf, import_hf, read_json_object
from rayshard.cluster.checkpoint.lora_export import export_merged, export_peft
from rayshard.cluster.checkpoint.peft_import import import_peft
from rayshard.cluster.checkpoint.offline_reshard import reshard_checkpoint, target_partition
from rayshard.cluster.checkpoint.reshard_report import build_plan, format_plan
from rayshard.cluster.cli.commands.checkpoint_refs import reading, resolve_checkpoint
from rayshard.cluster.pictures.resume_plot import plot_resume
from rayshard.cluster.progress import byte_bar
from rayshard.cluster.catalog import leases
from rayshard.cluster.catalog.store import Store, refuse_credentials
from rayshard.cluster.cli.config_file import read_config_file
from rayshard.plans.config import TrainConfig
from rayshard.plans.interop.model_description import ModelDescription
from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.plans.interop.hf_families import model_config_from_hf
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import ModelConfig, preset

HF_ONLY_EXPORT = (("merge", "--merge"), ("max_shard_mib", "--max-shard-mib"), ("no_optimizer", "--no-optimizer"))
DCP_ONLY_EXPORT = (("workers", "--workers"),)
NOT_FOR_EXPORT = {"hf": DCP_ONLY_EXPORT, "peft": HF_ONLY_EXPORT + DCP_ONLY_EXPORT,
                  "dcp": (("dtype", "--dtype"),) + HF_ONLY_EXPORT}
DCP_MODEL_SOURCES = (("hf_config", "--hf-config"), ("model", "--model"), ("config", "--config"))


def _layout(text: str):
    return ParallelLayout.parse(text)


def _stage_layout(counts: tuple[int, ...] | None):
    return list(counts) if counts else None


def run_plan(args: argparse.Namespace) -> int:
    ref = resolve_checkpoint(args)  # a dry run reads the manifest only: no lease
    chunks, metadata = read_manifest(ref.url)
    description = model_description(args)
    if description is not None or is_api_checkpoint(metadata):
        source = open_source(ref.url, description, chunks, metadata)
        if isinstance(source, MappedCheckpoint):
            raise CheckpointError(f"checkpoint {ref.url} holds torchtitan's names: a load onto a rayshard layout reads it "
                                  "through the name mapping, row by row, which a plan of byte ranges does not describe. Fix: "
                                  "`rayshard ckpt reshard` it (with the same --names/--model) and plan the copy")
        chunks, metadata = source.chunks, source.metadata
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
                           stage_layout=_stage_layout(args.stage_layout), log=bar.write, progress=bar,
                           description=model_description(args))
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


def _refuse_options(args: argparse.Namespace, options, fmt: str) -> None:
    """Options of the other --format, given: one line naming the first."""
    for dest, flag in options:
        if getattr(args, dest, None) not in (None, False):
            raise ConfigError(flag, getattr(args, dest), f"does not apply to --format {fmt}",
                              f"leave {flag} out, or pass the --format it belongs to")


def run_export(args: argparse.Namespace) -> int:
    _refuse_options(args, NOT_FOR_EXPORT[args.format], args.format)
    if args.merge and args.no_optimizer:
        raise ConfigError("--no-optimizer", True, "does not apply to --merge, whose export holds no optimizer moments (they "
                          "are the adapters', not the merged model's)", "leave --no-optimizer out")
    refuse_credentials(args.out, "--out")  # it is written into the export (DCP's .metadata names it)
    description = model_description(args)
    if description is not None and (args.format == "peft" or args.merge):
        raise ConfigError("--hf-config/--model/--config", description.source, "describes a rayshard.checkpoint checkpoint's "
                          "model, and a LoRA run's checkpoint records its own", "leave them out")
    with reading(args) as (store, [ref]), byte_bar(args, "export") as bar:
        if args.format == "dcp":
            export_dcp(ref.url, args.out, workers=args.workers or 1, log=bar.write, progress=bar, description=description)
            return 0
        if args.format == "peft":
            export_peft(ref.url, args.out, dtype=args.dtype, log=bar.write, progress=bar)
            return 0
        max_shard_bytes = int(args.max_shard_mib * 2**20) if args.max_shard_mib else DEFAULT_SHARD_BYTES
        if args.merge:
            with _reading_the_base(store, ref.url):
                export_merged(ref.url, args.out, dtype=args.dtype, max_shard_bytes=max_shard_bytes, log=bar.write,
                              progress=bar)
            return 0
        export_hf(ref.url, args.out, dtype=args.dtype, max_shard_bytes=max_shard_bytes,
                  include_optimizer=not args.no_optimizer, log=bar.write, progress=bar, description=description)
    return 0


@contextlib.contextmanager
def _reading_the_base(store: Store, checkpoint_url: str):
    """A reader lease on the base a LoRA checkpoint names, while a merge reads it (none needed
    when it names none: the export refuses it)."""
    base_url = (read_manifest(checkpoint_url)[1].get("lora_base") or {}).get("url")
    if base_url is None:
        yield
        return
    with leases.reading(store, store.resolve(base_url)):
        yield


def run_generate(args: argparse.Namespace) -> int:
    text = generate_text(args.directory, args.prompt, args.max_new_tokens, args.seed)
    print(text.replace("\n", "\\n"))  # one line, whatever the model wrote
    return 0


def run_import(args: argparse.Namespace) -> int:
    # The source's URL is recorded in the checkpoint (imported_from): never with credentials in it.
    refuse_credentials(args.directory, "DIRECTORY")
    if getattr(args, "hf_config", None):
        refuse_credentials(args.hf_config, "--hf-config")
    if args.format != "peft":
        _refuse_options(args, (("base", "--base"),), args.format)
    if args.format == "hf":
        _refuse_options(args, DCP_MODEL_SOURCES, "hf")
        with byte_bar(args, "import") as bar:
            import_hf(args.directory, Store(args.store), args.run, dtype=args.dtype, log=bar.write, progress=bar)
        return 0
    if args.format == "peft":
        return _import_peft(args)
    model, source, preset_name = dcp_model(args)
    with byte_bar(args, "import") as bar:
        import_dcp(args.directory, Store(args.store), args.run, model, source, dtype=args.dtype, model_preset=preset_name,
                   log=bar.write, progress=bar)
    return 0


def _import_peft(args: argparse.Namespace) -> int:
    _refuse_options(args, DCP_MODEL_SOURCES, "peft")
    if args.base is None:
        raise ConfigError("--base", None, "--format peft needs the checkpoint holding the adapter's base weights",
                          "add --base RUN[@STEP] (e.g. the run `ckpt import --format hf` made of the base's directory)")
    if args.dtype != "float32":
        raise ConfigError("--dtype", args.dtype, "does not apply to --format peft: adapters train in float32 whatever the "
                          "run's precision", "leave --dtype out")
    with reading(args, "base") as (store, [base]), byte_bar(args, "import") as bar:
        import_peft(args.directory, Store(args.store), args.run, base.url, log=bar.write, progress=bar)
    return 0


def model_description(args: argparse.Namespace) -> ModelDescription | None:
    """The model a rayshard.checkpoint checkpoint holds, from at most one of --hf-config, --model,
    --config, with --names; None when none is given (the checkpoint's own record is used)."""
    if not any(getattr(args, dest, None) for dest, _ in DCP_MODEL_SOURCES):
        if getattr(args, "names", None):
            raise ConfigError("--names", args.names, "names the naming of a model, and no model is given",
                              "add --model PRESET, --hf-config DIR or --config FILE")
        return None
    model, source, preset_name = dcp_model(args, "a rayshard.checkpoint checkpoint that recorded no model")
    return ModelDescription(model, args.names or "rayshard", preset_name, source)


def dcp_model(args: argparse.Namespace, what: str = "a DCP checkpoint records no model configuration") \
        -> tuple[ModelConfig, str, str | None]:
    """The model a DCP checkpoint holds, from exactly one of --hf-config, --model, --config:
    (its configuration, how the messages name it, its preset name if any)."""
    given = [(dest, flag) for dest, flag in DCP_MODEL_SOURCES if getattr(args, dest)]
    if len(given) != 1:
        raise ConfigError(", ".join(flag for _, flag in given) or "--hf-config/--model/--config",
                          [getattr(args, dest) for dest, _ in given] or None,
                          f"{what}: give exactly one of --hf-config DIR, --model PRESET, --config FILE", "name the configuration the checkpoint was trained with, "
                          "e.g. --hf-config ./Llama-3.2-1B or --model tiny")
    if args.model:
        return preset(args.model), f"--model {args.model}", args.model
    if args.config:
        choice = TrainConfig.from_dict(read_config_file(args.config)).model
        return choice.spec.validate(), f"--config {args.config}", choice.preset
    fs, path = fsspec.core.url_to_fs(args.hf_config)
    path = path.rstrip("/")
    config_path = path if path.endswith(".json") else f"{path}/config.json"
    if not fs.exists(config_path):
        raise ConfigError("--hf-config", args.hf_config, "has no config.json", "pass a Hugging Face model directory or its "
                          "config.json")
    return model_config_from_hf(read_json_object(fs, config_path), args.hf_config), f"--hf-config {args.hf_config}", None


def run_plot_resume(args: argparse.Namespace) -> int:
    result = plot_resume(Store(args.store), args.run, args.out, reference=args.reference)
    print(f"wrote {result['out']}: " + "; ".join(result["segments"]))
    if args.reference:
        print(f"largest relative difference to {args.reference} over {result['steps_compared']} steps: "
              f"{result['max_relative_difference']:.2e}")
    return 0
