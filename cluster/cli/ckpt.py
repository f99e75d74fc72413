"""`rayshard ckpt ...`: inspect, verify, reshard and convert checkpoints. Other modules add
subcommands to the same group (`ckpt_subcommands`)."""
from __future__ import annotations

import argparse

from rayshard.cluster import progress
from rayshard.cluster.cli.groups import command_group
from rayshard.cluster.cli.arg_types import AT_LEAST_ONE, AT_LEAST_ZERO, NON_NEGATIVE, POSITIVE, checkpoint_ref, layer_counts, png_path, run_name


def ckpt_subcommands(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:
    return command_group(commands, "ckpt", help="inspect, verify, reshard and convert checkpoints",
                         description="Checkpoints are addressed as RUN[@STEP] within --store, or by URL.")


def add_checkpoint_argument(parser: argparse.ArgumentParser, name: str = "checkpoint", store: bool = True) -> None:
    parser.add_argument(name, type=checkpoint_ref, metavar=name.upper() if name != "checkpoint" else "CKPT",
                        help="RUN[@STEP] within --store, or a checkpoint directory URL")
    if store:
        parser.add_argument("--store", default="./runs", metavar="URL", help="store holding the run (default ./runs)")


# ---- show ---------------------------------------------------------------------------------------


# ---- plan and reshard ---------------------------------------------------------------------------


# ---- verification -------------------------------------------------------------------------------


# ---- Hugging Face -------------------------------------------------------------------------------


# ---- continuity picture -------------------------------------------------------------------------


def register(commands: argparse._SubParsersAction) -> None:
    group = ckpt_subcommands(commands)

    show = group.add_parser("show", help="a checkpoint's metadata and size")
    add_checkpoint_argument(show)
    show.add_argument("--json", action="store_true", help="also print the full metadata as JSON")
    show.set_defaults(run_command="rayshard.cluster.cli.commands.catalog:run_show")

    plan = group.add_parser("plan", help="dry run: what each rank of another layout would read (no data moved)")
    add_checkpoint_argument(plan)
    _target_arguments(plan)
    plan.add_argument("--min-segment-kib", type=NON_NEGATIVE, default=None, metavar="K",
                      help="read whole rows when a column split's row segments are shorter than K KiB (fewer, larger "
                           "requests); default: what a load from this store does (0 on local files: only the needed "
                           "columns; 256 on object stores, where each segment is a request)")
    plan.add_argument("--show-ranks", type=AT_LEAST_ZERO, default=16, metavar="N", help="list every rank up to N ranks (default 16)")
    _model_arguments(plan)
    plan.set_defaults(run_command="rayshard.cluster.cli.commands.ckpt:run_plan")

    reshard = group.add_parser("reshard", help="write a copy laid out for another layout, as a new run (offline, on Ray)")
    add_checkpoint_argument(reshard)
    _target_arguments(reshard)
    reshard.add_argument("--run", type=run_name, required=True, metavar="NAME", help="run name of the copy (same store)")
    reshard.add_argument("--workers", type=AT_LEAST_ONE, metavar="N", help="Ray actors playing the target ranks (default one per rank, at most as many as the cluster's CPUs hold)")
    reshard.add_argument("--cpus-per-worker", type=NON_NEGATIVE, default=1.0, metavar="F", help="CPUs each actor reserves (default 1)")
    reshard.add_argument("--local", action="store_true", help="play every rank in this process instead of Ray actors")
    _model_arguments(reshard)
    progress.add_arguments(reshard)
    reshard.set_defaults(run_command="rayshard.cluster.cli.commands.ckpt:run_reshard")

    digest = group.add_parser("digest", help="per-tensor SHA-256 of the global tensors: equal whatever layout wrote them")
    add_checkpoint_argument(digest)
    digest.add_argument("--json", action="store_true")
    digest.add_argument("--block-mib", type=POSITIVE, default=64, metavar="M", help="rows streamed per read (default 64 MiB)")
    progress.add_arguments(digest)
    digest.set_defaults(run_command="rayshard.cluster.cli.commands.ckpt:run_digest")

    diff = group.add_parser("diff", help="compare two checkpoints tensor by tensor (exit 1 if they differ)")
    add_checkpoint_argument(diff, "a", store=False)
    add_checkpoint_argument(diff, "b")
    diff.add_argument("--all", action="store_true", help="also list the equal tensors")
    progress.add_arguments(diff)
    diff.set_defaults(run_command="rayshard.cluster.cli.commands.ckpt:run_diff")

    export = group.add_parser("export", help="write a Hugging Face directory (config.json + safetensors), a PEFT adapter "
                                             "or a torch DCP directory",
                              description="--format hf (default): config.json + safetensors of the model's family; of a "
                                          "LoRA run's checkpoint with --merge: its base with the adapters merged in (in "
                                          "float32). --format peft: a LoRA run's adapters as adapter_model.safetensors + "
                                          "adapter_config.json, which peft.PeftModel.from_pretrained loads onto the base's "
                                          "Hugging Face directory. --format dcp: a torch.distributed.checkpoint directory of "
                                          "torchtitan's Llama (weights, AdamW moments and step), which dcp.load reads on any "
                                          "world size.")
    add_checkpoint_argument(export)
    export.add_argument("--format", choices=["hf", "peft", "dcp"], default="hf")
    export.add_argument("--out", required=True, metavar="DIR")
    export.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="hf, peft: weights dtype (default: as stored)")
    export.add_argument("--merge", action="store_true",
                        help="hf: a LoRA run's checkpoint as its base with W + (alpha/r) B A for each adapted projection")
    export.add_argument("--max-shard-mib", type=POSITIVE, metavar="M",
                        help="hf: split into model-0000i-of-0000n.safetensors + index past M MiB (default 2048)")
    export.add_argument("--no-optimizer", action="store_true", help="hf: leave out the optimizer moments (rayshard-optimizer/)")
    export.add_argument("--workers", type=AT_LEAST_ONE, metavar="N",
                        help="dcp: writers, each filling its own __N_0.distcp file in parallel (default 1)")
    _model_arguments(export, " (for --format dcp: writes torchtitan's layout instead of the state dict's own keys)")
    progress.add_arguments(export)
    export.set_defaults(run_command="rayshard.cluster.cli.commands.ckpt:run_export")

    generate = group.add_parser("generate", help="a line of text from an exported directory, with transformers",
                                description="AutoTokenizer + AutoModelForCausalLM.generate (sampled, seeded) on a `ckpt export` --out.")
    generate.add_argument("directory", metavar="DIR", help="the --out of `ckpt export` (with its tokenizer)")
    generate.add_argument("--prompt", default="def ", help="text to continue (default 'def ')")
    generate.add_argument("--max-new-tokens", type=AT_LEAST_ONE, default=24, metavar="N")
    generate.add_argument("--seed", type=int, default=0, metavar="N", help="sampling seed (top-k 40)")
    generate.set_defaults(run_command="rayshard.cluster.cli.commands.ckpt:run_generate")

    importer = group.add_parser("import", help="make a checkpoint (RUN@STEP) from a Hugging Face directory (Llama, Qwen2/3, "
                                               "Mistral, Qwen2/3-MoE), a PEFT LoRA adapter or a torch DCP directory "
                                               "(torchtitan's Llama)",
                                description="--format hf (default): a Hugging Face model directory. --format peft: a PEFT "
                                            "LoRA adapter directory onto the base checkpoint --base, as a LoRA run's "
                                            "checkpoint at step 0 that `rayshard train --resume` continues. --format dcp: a "
                                            "torch.distributed.checkpoint directory of torchtitan's Llama (weights, AdamW "
                                            "moments and step); DCP records no model configuration, so give it with "
                                            "exactly one of --hf-config, --model or --config.")
    importer.add_argument("directory", metavar="DIR")
    importer.add_argument("--format", choices=["hf", "peft", "dcp"], default="hf")
    importer.add_argument("--base", type=checkpoint_ref, metavar="CKPT",
                          help="peft: the checkpoint holding the adapter's base weights (RUN[@STEP] within --store, or URL)")
    importer.add_argument("--run", type=run_name, required=True, metavar="NAME")
    importer.add_argument("--store", default="./runs", metavar="URL")
    importer.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="training dtype (default float32)")
    importer.add_argument("--hf-config", metavar="DIR", help="dcp: the model's Hugging Face config.json (or its directory)")
    importer.add_argument("--model", metavar="PRESET", help="dcp: the model is this preset (tiny, small, medium, 1b, ...)")
    importer.add_argument("--config", metavar="FILE", help="dcp: the model is this train config file's model section")
    progress.add_arguments(importer)
    importer.set_defaults(run_command="rayshard.cluster.cli.commands.ckpt:run_import")

    plot = group.add_parser("plot-resume", help="PNG of loss curves: a run on layout A, its resume on layout B, a reference")
    plot.add_argument("--store", default="./runs", metavar="URL")
    plot.add_argument("--run", type=run_name, action="append", required=True, metavar="NAME",
                      help="run(s) to draw; each layout segment gets its own colour (repeatable)")
    plot.add_argument("--reference", type=run_name, metavar="NAME", help="the uninterrupted run to compare with")
    plot.add_argument("--out", type=png_path, default="resume.png", metavar="PNG")
    plot.set_defaults(run_command="rayshard.cluster.cli.commands.ckpt:run_plot_resume")


def _model_arguments(parser: argparse.ArgumentParser, note: str = "") -> None:
    """The model of a checkpoint saved by rayshard.checkpoint that recorded none (decision 128)."""
    group = parser.add_argument_group("model of a rayshard.checkpoint checkpoint",
                                      "a checkpoint saved from a training loop's state dict without model=... names no "
                                      "model: give it with one of these" + note)
    group.add_argument("--hf-config", metavar="DIR", help="the model's Hugging Face config.json (or its directory)")
    group.add_argument("--model", metavar="PRESET", help="the model is this preset (tiny, small, medium, 1b, ...)")
    group.add_argument("--config", metavar="FILE", help="the model is this train config file's model section")
    group.add_argument("--names", choices=["rayshard", "torchtitan"], default=None,
                       help="the naming of the state dict's module names: rayshard's own (default) or torchtitan's Llama")


def _target_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--to", required=True, metavar="LAYOUT", help="target layout, e.g. dp=1,tp=2,pp=2")
    parser.add_argument("--schedule", metavar="NAME", help="pipeline schedule of the target (decides stage placement)")
    parser.add_argument("--stage-layout", type=layer_counts, metavar="COUNTS", help="layers per stage, e.g. 1,3 (default: even)")
