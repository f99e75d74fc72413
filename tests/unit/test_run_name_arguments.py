"""No run name given on the command line reaches outside --store (issue 43, finding 3): every
argument of every command that names a run (`--run`, `--reference`) or a checkpoint as RUN[@STEP]
refuses '..', '/', absolute paths, schemes and empty names in one line, exit 2, naming the value
and the rule. The commands are found by walking the CLI's own parsers, so a new command that
takes a run is covered without editing this file."""
from __future__ import annotations

import argparse

import pytest

from rayshard.cluster.cli.main import build_parser, main
from rayshard.plans.errors import ConfigError
from rayshard.plans.run_names import check_checkpoint_ref, check_run_name

RUN_OPTIONS = {"--run", "--reference"}  # options whose value is a run name in --store
CHECKPOINT_METAVARS = {"CKPT", "A", "B"}  # positionals holding RUN[@STEP] or a checkpoint URL
HOSTILE_NAMES = ["../X", "/tmp/elsewhere", "a/../../b", "..", ".", "", "s3://bucket/x", "s3:x", "a b", ".hidden"]
HOSTILE_REFS = ["..@1", "..", ".", "@3", ".hidden@2", "s3:x@1", "a b@1"]  # a URL or a path is a legal CKPT


def _commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, words + (name,))
    if words:
        yield words, parser


def _run_arguments():
    found = []
    for words, parser in _commands(build_parser()):
        for action in parser._actions:
            if set(action.option_strings) & RUN_OPTIONS:
                found += [pytest.param(words, [sorted(set(action.option_strings) & RUN_OPTIONS)[0], value], value,
                                       id=f"{' '.join(words)} {action.option_strings[0]}={value}") for value in HOSTILE_NAMES]
            elif not action.option_strings and action.metavar in CHECKPOINT_METAVARS and not action.choices:
                before = ["r"] * [a.metavar for a in parser._actions if not a.option_strings].index(action.metavar)
                found += [pytest.param(words, before + [value], value, id=f"{' '.join(words)} {action.metavar}={value}")
                          for value in HOSTILE_REFS]
    return found


RUN_ARGUMENTS = _run_arguments()


def test_the_walk_finds_every_command_that_names_a_run():
    commands = {" ".join(param.values[0]) for param in RUN_ARGUMENTS}
    assert {"train", "ckpt ls", "ckpt gc", "ckpt show", "ckpt verify", "ckpt plan", "ckpt reshard", "ckpt digest",
            "ckpt diff", "ckpt export", "ckpt import", "ckpt plot-resume"} <= commands, commands


@pytest.mark.parametrize("words, argv, value", RUN_ARGUMENTS)
def test_a_name_outside_the_store_is_refused_in_one_line(words, argv, value, capsys, tmp_path):
    store = tmp_path / "store"
    with pytest.raises(SystemExit) as exit_:
        code = main([*words, *argv, "--store", str(store)])
        raise SystemExit(code)  # a command that ran to its end: fail below on its exit code
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert err.count("\n") == 1 and err.startswith("rayshard: error: "), err
    assert repr(value) in err and "not a run name" in err and "no '/', '..'" in err, err
    assert not (tmp_path / "X").exists() and not store.exists()  # nothing was created, inside or out


@pytest.mark.parametrize("value", HOSTILE_NAMES)
def test_the_library_refuses_the_same_names(value):
    with pytest.raises(ConfigError, match="not a run name"):
        check_run_name(value)


@pytest.mark.parametrize("ref", ["r", "r@20", "latest", "my-run.v2_1@3", "./runs/r/checkpoints/step-00000001",
                                 "../other/r/checkpoints/step-00000001", "/abs/checkpoints/step-00000001",
                                 "s3://bucket/runs/r/checkpoints/step-00000001"])
def test_runs_and_checkpoint_locations_are_accepted(ref):
    assert check_checkpoint_ref(ref) == ref
