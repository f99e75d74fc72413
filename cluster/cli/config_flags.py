"""Command-line flags generated from the config's fields (plans/options.py), and read back.

Each field with a flag becomes one argument, in an argument group per section, typed by its
annotation: a bool is a switch, an int or a float converts, a tuple of ints reads comma-separated
counts (`layer_counts`); choices, metavar and help come from the field. Every argument defaults
to None, "not given", so a flag changes the config file's value only when the user passes it,
and `config_overrides` turns the given ones back into the dotted overrides `with_overrides` takes.
"""
from __future__ import annotations

import argparse
import types
import typing

from rayshard.cluster.cli.arg_types import layer_counts
from rayshard.plans.options import Setting, sections, settings


def add_config_flags(parser: argparse.ArgumentParser, kind: type) -> dict[str, argparse._ArgumentGroup]:
    """A flag for every field of the config `kind` that has one; the top level's on `parser`, each
    section's in its own group. Returns the groups by section path ("" is `parser` itself), for a
    command's own flags that belong beside a section's."""
    groups = {"": parser}
    for path, section in sections(kind):
        groups[path] = parser.add_argument_group(path, section.about)
    for setting in settings(kind):
        if setting.flag is not None:
            groups[setting.section].add_argument(setting.flag_name, **_argument(setting))
    return groups


def add_flag(parser, kind: type, name: str, **changes) -> argparse.Action:
    """The flag of the field `name` of the section `kind` on a command that shares it without
    building a config (`plan layout --precision`): its name, metavar, choices and help from the
    field, `changes` the command's own (a default, a range-checked type, its own help)."""
    setting = next((setting for setting in settings(kind) if setting.name == name and setting.flag is not None), None)
    if setting is None:
        raise KeyError(f"{kind.__name__} has no field {name!r} with a flag")
    return parser.add_argument(setting.flag_name, **{**_argument(setting), **changes})


def config_overrides(args: argparse.Namespace, kind: type) -> dict[str, object]:
    """Dotted field -> the flag's value, for every flag of `kind` (None where not given). A flag
    that names a file (--schedule-csv) is left to the command, which reads the file."""
    return {setting.path: getattr(args, _dest(setting)) for setting in settings(kind)
            if setting.flag is not None and not setting.flag.reads_file}


def _argument(setting: Setting) -> dict:
    flag = setting.flag
    argument = {"dest": _dest(setting), "help": flag.help, "default": None}
    kind = _value_type(setting.annotation)
    if flag.reads_file:
        kind = str
    if kind is bool:
        return {**argument, "action": "store_true"}
    if flag.metavar:
        argument["metavar"] = flag.metavar
    if flag.choices:
        argument["choices"] = flag.choices
    if kind == tuple[int, ...]:
        argument["type"] = layer_counts  # whole numbers >= 0, e.g. layers per stage: 1,3
    elif kind in (int, float):
        argument["type"] = kind
    elif kind is not str:
        raise TypeError(f"{setting.path}: no command-line form for {kind}; mark the field file_only or give it one here")
    return argument


def _value_type(annotation):
    """The annotation without its None (`int | None` -> int)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (kind,) = [option for option in typing.get_args(annotation) if option is not type(None)]
        return kind
    return annotation


def _dest(setting: Setting) -> str:
    return setting.flag_name.lstrip("-").replace("-", "_")
