"""The sectioned config: each option written once (its field), its flag generated from the field,
every flag of before still there, and a config file of before (flat keys) still read."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from rayshard.cluster.cli.commands.train import config_from_args
from rayshard.cluster.cli.config_flags import config_overrides
from rayshard.cluster.cli.main import build_parser, main
from rayshard.plans.config import NumericsConfig, PipelineConfig, TrainConfig, with_overrides
from rayshard.plans.config.flat_keys import FLAT_KEYS
from rayshard.plans.errors import ConfigError
from rayshard.plans.options import FILE_ONLY, FLAG, SECTION, settings
from rayshard.plans.training.model_spec import preset

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# `rayshard train`'s flags before the sections, with the argparse names code reads them by.
FLAGS_OF_BEFORE = {
    "--config": "config", "--model": "model", "--model-factory": "model_factory", "--run": "run", "--store": "store",
    "--dp": "dp", "--fsdp": "fsdp", "--tp": "tp", "--pp": "pp", "--vpp": "vpp", "--ep": "ep",
    "--world-size": "world_size", "--steps": "steps", "--ckpt-every": "ckpt_every", "--resume": "resume",
    "--async-save": "async_save", "--verify-resume": "verify_resume", "--global-batch": "global_batch",
    "--seq-len": "seq_len", "--microbatches": "microbatches", "--schedule": "schedule", "--stage-layout": "stage_layout",
    "--schedule-csv": "schedule_csv", "--pipeline-timeout": "pipeline_timeout", "--cpus-per-rank": "cpus_per_rank",
    "--gpus-per-rank": "gpus_per_rank", "--start-timeout": "start_timeout", "--call-timeout": "call_timeout",
    "--seed": "seed", "--lr": "lr", "--warmup-steps": "warmup_steps", "--data": "data", "--precision": "precision",
    "--ac": "ac", "--compile": "compile", "--sp": "sp", "--tensorboard": "tensorboard",
    "--wandb-project": "wandb_project", "--elastic": "elastic", "--min-ranks": "min_ranks",
    "--max-ranks": "max_ranks", "--max-failures": "max_failures", "--backoff-s": "backoff_s",
    "--memory-gib": "memory_gib",
}

FLAT = """\
model_preset: tiny
layout: {dp: 2, tp: 2}
steps: 12
global_batch: 8
seq_len: 32
microbatches: 2
schedule: gpipe
ckpt_every: 4
resume: auto
precision: bf16
ac: selective
tensorboard: true
collective_timeout_s: 120
pipeline_timeout_s: 30
"""

SECTIONED = """\
steps: 12
global_batch: 8
seq_len: 32
model: {preset: tiny}
layout: {dp: 2, tp: 2}
pipeline: {microbatches: 2, schedule: gpipe, timeout_s: 30}
checkpoint: {every: 4, resume: auto}
numerics: {precision: bf16, ac: selective}
metrics: {tensorboard: true}
resources: {collective_timeout_s: 120}
"""


def _train_parser():
    commands = next(action for action in build_parser()._actions if action.choices and "train" in action.choices)
    return commands.choices["train"]


def _section_fields(kind, prefix=""):
    """Every dataclass field of the config, sections walked, with its metadata."""
    for item in dataclasses.fields(kind):
        yield f"{prefix}{item.name}", item
        if SECTION in item.metadata:
            yield from _section_fields(item.metadata[SECTION].kind, f"{prefix}{item.name}.")


def test_every_field_of_every_section_has_a_flag_or_is_deliberately_file_only():
    missing = [path for path, item in _section_fields(TrainConfig)
               if not ({FLAG, FILE_ONLY, SECTION} & set(item.metadata))]
    assert not missing, missing
    flagged = [setting.flag_name for setting in settings(TrainConfig) if setting.flag is not None]
    assert len(flagged) == len(set(flagged))  # no two fields claim one flag
    file_only = {setting.path for setting in settings(TrainConfig) if setting.flag is None}
    assert file_only == {"model.spec", "data.max_bytes", "data.dataset", "data.prefetch_steps", "data.read_timeout_s",
                         "optimizer.min_lr", "optimizer.decay_steps", "optimizer.weight_decay", "optimizer.beta1",
                         "optimizer.beta2", "optimizer.eps", "optimizer.grad_clip", "resources.collective_timeout_s",
                         "dpo.logprobs_file"}


def test_a_field_without_its_flag_or_a_file_only_mark_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Undecided:
        knob: int = 1

    with pytest.raises(TypeError, match="Undecided.knob says neither its flag nor that it is file-only"):
        settings(Undecided)


def test_every_flag_of_before_is_still_there_by_its_name():
    parser = _train_parser()
    destinations = {option: action.dest for action in parser._actions for option in action.option_strings}
    assert {flag: destinations.get(flag) for flag in FLAGS_OF_BEFORE} == FLAGS_OF_BEFORE


def test_a_flag_derived_from_metadata_carries_the_fields_help_and_constraint(capsys):
    help_text = " ".join(_train_parser().format_help().split())
    precision = next(s for s in settings(NumericsConfig) if s.name == "precision")
    assert f"--precision {{fp32,bf16}} {precision.flag.help}" in help_text
    stage_layout = next(s for s in settings(PipelineConfig) if s.name == "stage_layout")
    assert f"--stage-layout N,N,.. {stage_layout.flag.help}" in help_text
    assert "numerics: precision and speed" in help_text  # each section's flags under its own heading
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--precision", "fp16"])
    assert re.search(r"argument --precision: invalid choice: 'fp16' \(choose from '?fp32'?, '?bf16'?\)",
                     capsys.readouterr().err)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--stage-layout", "1,x"])
    assert "argument --stage-layout: '1,x' is not comma-separated layer counts, e.g. 1,3" in capsys.readouterr().err


def test_plan_layout_takes_the_same_fields_choices(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "layout", "--ranks", "4", "--ac", "some"])
    assert re.search(r"argument --ac: invalid choice: 'some' \(choose from '?none'?, '?full'?, '?selective'?\)",
                     capsys.readouterr().err)


def test_each_flag_reaches_its_field():
    values = {bool: None, int: "3", float: "0.5", str: "x"}
    argv, wanted = ["train"], {}
    for setting in settings(TrainConfig):
        if setting.flag is None or setting.flag.reads_file or setting.path == "model.preset":
            continue  # --schedule-csv is a file read into rows, --model a whole model section: tests of their own
        kind = next((k for k in values if k is setting.annotation or setting.annotation in (k | None,)), tuple)
        text = setting.flag.choices[-1] if setting.flag.choices else values.get(kind, "1,3")
        argv += [setting.flag_name] + ([] if text is None else [text])
        wanted[setting.path] = {None: True, "3": 3, "0.5": 0.5, "1,3": (1, 3)}.get(text, text)
    config = with_overrides(TrainConfig(), **config_overrides(build_parser().parse_args(argv), TrainConfig))
    reached = {}
    for path in wanted:
        head, _, rest = path.partition(".")
        reached[path] = getattr(getattr(config, head), rest) if rest else getattr(config, head)
    assert reached == wanted


def test_async_save_reaches_the_config(tmp_path):
    def config(*flags, text=None):
        argv = ["train", "--store", str(tmp_path / "runs"), *flags]
        if text is not None:
            (tmp_path / "run.yaml").write_text(text)
            argv += ["--config", str(tmp_path / "run.yaml")]
        return config_from_args(build_parser().parse_args(argv))

    assert config("--async-save").checkpoint.async_save is True
    assert config().checkpoint.async_save is False
    assert config(text="checkpoint: {async_save: true}\n").checkpoint.async_save is True  # a flag not given keeps it


def test_an_old_flat_file_loads_with_one_deprecation_line_and_equals_its_sectioned_form(tmp_path, capsys):
    (tmp_path / "flat.yaml").write_text(FLAT)
    (tmp_path / "sectioned.yaml").write_text(SECTIONED)
    store = ["--store", str(tmp_path / "runs")]
    flat = config_from_args(build_parser().parse_args(["train", "--config", str(tmp_path / "flat.yaml"), *store]))
    lines = capsys.readouterr().err.splitlines()
    sectioned = config_from_args(build_parser().parse_args(["train", "--config", str(tmp_path / "sectioned.yaml"),
                                                            *store]))
    assert capsys.readouterr().err == ""  # the sectioned form is the current one
    assert flat == sectioned
    assert (flat.checkpoint.every, flat.numerics.precision, flat.pipeline.timeout_s) == (4, "bf16", 30.0)
    assert len(lines) == 1 and lines[0].startswith(f"rayshard: warning: {tmp_path / 'flat.yaml'}: flat config keys "
                                                   "are deprecated: model_preset -> model.preset, "), lines
    for key in yaml.safe_load(FLAT):
        if key in FLAT_KEYS:
            assert f"{key} -> {'.'.join(FLAT_KEYS[key])}" in lines[0]
    assert TrainConfig.from_dict(yaml.safe_load(FLAT)) == TrainConfig.from_dict(yaml.safe_load(SECTIONED))


def test_the_shipped_configs_are_sectioned():
    for name in ("demo", "demo-bpe", "small"):
        data = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text(encoding="utf-8"))
        assert not set(data) & set(FLAT_KEYS), name
        TrainConfig.from_dict(data).validate()


@pytest.mark.parametrize("text, field, fragment", [
    ("precision: bf16\nnumerics: {precision: fp32}\n", "precision",
     "is set twice: as `precision` and as `numerics.precision`. Fix: keep only numerics.precision"),
    ("ckpt_every: soon\n", "ckpt_every", "must be an integer, not a string. Fix: write ckpt_every as a whole number"),
    ("checkpoint: {every: soon}\n", "checkpoint.every", "must be an integer"),
    ("numerics: fast\n", "numerics", "must be a mapping, not a string"),
    ("checkpoint: {evry: 2}\n", "checkpoint", "unknown key(s) ['evry']"),
])
def test_a_bad_value_in_either_form_is_named_as_written(text, field, fragment):
    with pytest.raises(ConfigError) as error:
        TrainConfig.from_dict(yaml.safe_load(text))
    assert error.value.field == field and fragment in str(error.value), str(error.value)


def test_a_bad_flat_key_through_the_cli_is_the_warning_and_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAYSHARD_DEBUG", raising=False)
    (tmp_path / "bad.yaml").write_text("ckpt_every: -1\n")
    assert main(["train", "--config", str(tmp_path / "bad.yaml"), "--store", str(tmp_path / "runs")]) == 2
    warning, error = capsys.readouterr().err.splitlines()
    assert warning.startswith("rayshard: warning:") and "ckpt_every -> checkpoint.every" in warning
    assert error == "rayshard: error: ckpt_every=-1: must be >= 0 (0 saves only at the end). Fix: set --ckpt-every 0 or more"


def test_a_bare_model_shape_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"takes a ModelChoice: wrap the shape as ModelChoice\(spec=...\)"):
        TrainConfig(model=preset("tiny"))
