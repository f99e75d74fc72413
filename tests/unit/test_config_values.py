"""A config file's values of the wrong type are named in one line, before any constraint reads
them; the conversions a person means (PyYAML's "3e-4" strings, `model: small`) are made."""
import math

import pytest
import yaml

from rayshard.cluster.cli.main import main
from rayshard.plans.config import TrainConfig, with_overrides
from rayshard.plans.errors import ConfigError


def from_yaml(text: str) -> TrainConfig:
    return TrainConfig.from_dict(yaml.safe_load(text))


@pytest.mark.parametrize("text, field, fragment", [
    ('compile: "no"', "compile", "must be true or false, not a string"),
    ("tensorboard: 1", "tensorboard", "must be true or false, not an integer"),
    ("steps: ten", "steps", "must be an integer, not a string"),
    ("steps: 2.5", "steps", "must be an integer"),
    ("steps: true", "steps", "must be an integer, not true/false"),
    ("run: 2024", "run", 'quoted string, e.g. "2024"'),
    ("precision: 16", "precision", "must be a string"),
    ("steps:", "steps", "must be set"),
    ("optimizer: {lr: fast}", "optimizer.lr", "must be a finite number, not a string"),
    ("optimizer: {lr: .nan}", "optimizer.lr", "not NaN"),
    ("collective_timeout_s: .inf", "collective_timeout_s", "not infinite"),
    ("layout: {tp: 2.5}", "layout.tp", "must be an integer"),
    ("layout: 4", "layout", "must be a mapping, not an integer"),
    ("data: [1]", "data", "must be a mapping, not a list"),
    ("model: 5", "model", "must be a mapping"),
    ("model: {dim: big}", "model.dim", "must be an integer"),
    ("model: {preset: 3}", "model.preset", "a preset's name"),
    ("model: {user: {}}", "model", "unknown key(s) ['user']"),
    ("stage_layout: [1, x]", "stage_layout", "must be a list of integers"),
    ("bogus: 1", "config", "unknown key(s) ['bogus']"),
])
def test_a_value_of_the_wrong_type_is_named_with_its_fix(text, field, fragment):
    with pytest.raises(ConfigError) as error:
        from_yaml(text)
    assert error.value.field == field
    assert fragment in str(error.value)
    assert "Fix: " in str(error.value)


def test_the_conversions_a_person_means_are_made():
    config = from_yaml("model: small\nsteps: 1.0e1\noptimizer: {lr: 3e-4, min_lr: 1e-5}\n"
                       "layout: {pp: 2.0}\nstage_layout: [3, 5]\nseed: '7'\n")
    assert config.model.preset == "small"
    assert config.steps == 10 and type(config.steps) is int
    assert config.optimizer.lr == 3e-4 and config.optimizer.min_lr == 1e-5  # PyYAML gave strings
    assert config.layout.pp == 2 and type(config.layout.pp) is int
    assert config.pipeline.stage_layout == (3, 5)
    assert config.seed == 7


def test_an_optional_field_takes_empty_and_a_value():
    assert from_yaml("pipeline_timeout_s:").pipeline.timeout_s is None
    assert from_yaml("pipeline_timeout_s: 30").pipeline.timeout_s == 30.0
    assert from_yaml("model: {sliding_window: 16}").model.spec.sliding_window == 16


def test_command_line_overrides_are_checked_too():
    with pytest.raises(ConfigError, match="optimizer.lr=nan"):
        with_overrides(TrainConfig(), **{"optimizer.lr": math.nan})
    with pytest.raises(ConfigError, match="call_timeout_s=inf"):
        with_overrides(TrainConfig(), **{"resources.call_timeout_s": math.inf})
    assert with_overrides(TrainConfig(), **{"optimizer.lr": 1e-3}, steps=3).optimizer.lr == 1e-3


def test_the_command_line_prints_one_line_and_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("RAYSHARD_DEBUG", raising=False)
    config = tmp_path / "bad.yaml"
    config.write_text("model: tiny\nsteps: ten\n")
    assert main(["train", "--config", str(config), "--store", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == ["rayshard: error: steps='ten': must be an integer, not a string. "
                                        "Fix: write steps as a whole number, e.g. 20"]


@pytest.mark.parametrize("content, fragment", [
    (b"steps: [1\n", "is not valid YAML at line 2, column 1"),
    (b"a: b: c\n", "is not valid YAML at line 1, column 5: mapping values are not allowed here"),
    (b"\xff\xfe steps\n", "is not UTF-8 text (byte 0)"),
    (b"- steps\n", "must hold a YAML mapping"),
    (None, "is a directory"),
])
def test_a_config_file_that_cannot_be_read_is_named_in_one_line(tmp_path, capsys, content, fragment):
    config = tmp_path / "config.yaml"
    if content is None:
        config.mkdir()
    else:
        config.write_bytes(content)
    assert main(["train", "--config", str(config), "--store", str(tmp_path / "runs")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and str(config) in lines[0], lines
