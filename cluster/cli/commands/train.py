"""`rayshard train`: the config file plus command-line overrides, then a run (or an elastic one)."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from rayshard.actors.model.user_model import describe_factory
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.cli.config_file import read_config_file
from rayshard.cluster.cli.config_flags import config_overrides
from rayshard.cluster.cli.train import DEFAULT_CONFIG
from rayshard.cluster.data.training_data import with_dataset_vocabulary
from rayshard.cluster.run.controller import State
from rayshard.cluster.run.elastic import train_elastic
from rayshard.cluster.run.pipeline_order_file import read_csv_rows
from rayshard.cluster.run.resume_model import with_resumed_model
from rayshard.cluster.run.train import train
from rayshard.plans.config import ModelChoice, TrainConfig, with_overrides
from rayshard.plans.config.flat_keys import deprecation_note, flat_keys_in
from rayshard.plans.elastic import FailurePolicy, ScalingPolicy
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.chooser import PINNABLE_DEGREES
from rayshard.plans.pipeline.csv_order import CSV_SCHEDULE, parse_pipeline_csv
from rayshard.plans.pipeline.plan import check_order_file
from rayshard.plans.pipeline.schedules import schedule_spec


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    path = args.config or DEFAULT_CONFIG
    data = read_config_file(path)
    if flat_keys_in(data):  # they still load (TrainConfig.from_dict moves them); say where they belong now
        print(f"rayshard: warning: {path}: {deprecation_note(flat_keys_in(data))}", file=sys.stderr)
    # The user named the model: a flag, or a model section (or a top-level `model_preset:`) in a
    # config file of their own (the embedded default config's `tiny` is not a choice). Otherwise a
    # resume builds the checkpoint's.
    named = bool(args.model) or bool(args.model_factory) or (
        args.config is not None and ("model" in data or "model_preset" in data))
    if args.model and args.model_factory:
        raise ConfigError("--model-factory", args.model_factory, "names a second model beside --model",
                          "pass either a preset (--model) or your own model (--model-factory)")
    if args.model:  # a preset on the command line replaces the file's model section entirely
        data["model"] = {"preset": args.model}
    model_section = data.get("model")
    factory = args.model_factory or (model_section.pop("factory", None) if isinstance(model_section, dict) else None)
    if factory and model_section and args.model_factory is None and set(model_section) - {"preset"}:
        raise ConfigError("model", sorted(model_section), "sets preset fields beside a factory",
                          "a factory's model has its own sizes: keep only `factory` in the model section")
    if factory:
        data.pop("model", None)
    config = TrainConfig.from_dict(data)
    if factory:  # the user's own model, described on the meta device (actors/model/user_model.py)
        config = replace(config, model=ModelChoice(factory, describe_factory(factory)))
    overrides = config_overrides(args, TrainConfig)
    del overrides["model.preset"]  # a preset flag replaced the file's whole model section above, not just its name
    file_layout = data.get("layout") or {}
    pipelined = (args.pp if args.pp is not None else file_layout.get("pp", 1)) > 1
    if pipelined and args.schedule and args.vpp is None and "vpp" not in file_layout:
        # The schedule fixes how many stages a rank runs; don't make the user repeat it.
        overrides["layout.vpp"] = schedule_spec(args.schedule).default_vpp
    if args.schedule_csv:
        # The file fixes ranks, stages per rank and microbatches: don't make the user repeat them.
        rows = read_csv_rows(args.schedule_csv)
        order = parse_pipeline_csv(rows, args.schedule_csv)
        check_order_file(order)  # a deadlock is named with the file, before any rank starts
        overrides.update({"pipeline.schedule_csv": rows, "pipeline.schedule": CSV_SCHEDULE})
        for key, flag, value in (("layout.pp", "pp", order.pp), ("layout.vpp", "vpp", order.vpp),
                                 ("pipeline.microbatches", "microbatches", order.microbatches)):
            if getattr(args, flag) is None:
                overrides[key] = value
    config = with_dataset_vocabulary(with_overrides(config, **overrides),
                                     note=lambda line: print(f"rayshard: note: {line}", file=sys.stderr))
    return with_resumed_model(config, named).validate()


def run_train(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    Store(config.store).with_bounded_calls().require_container()  # before Ray: s3fs would create it at the first save
    if args.elastic:
        return _run_elastic(args, config)

    # A StepFailed (each rank's own error) and errors raised on ranks are reported by main.py.
    result = train(config)
    if result.checkpoints:
        print(f"latest checkpoint: {result.checkpoints[-1]}")
    return 0


def _run_elastic(args: argparse.Namespace, config) -> int:
    # Dimensions given on the command line are pins (ep too: --ep 1 keeps an MoE model's experts
    # FSDP-sharded); the chooser picks the rest for each attempt.
    pinned = {name: getattr(args, name) for name in PINNABLE_DEGREES if getattr(args, name)}
    controller, state = train_elastic(
        config, pinned, ScalingPolicy(args.min_ranks, args.max_ranks),
        FailurePolicy(max_failures=args.max_failures, backoff_s=args.backoff_s),
        memory_per_rank_bytes=args.memory_gib * 2**30)
    if state is State.ERRORED:
        print(f"rayshard: error: elastic training stopped: {controller.history[-1].detail}", file=sys.stderr)
        return 1
    return 0
