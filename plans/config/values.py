"""A config file's values checked against the typed records they fill, before any constraint.

YAML hands back whatever was written: `compile: "no"` is a non-empty string (true to Python),
`steps: ten` a string that breaks the first comparison with a traceback, `lr: 3e-4` a string too
(PyYAML reads YAML 1.1, where an exponent without a dot is not a number). Each field's value is
checked here against the field's annotation, named in one line when it does not fit, and the few
unambiguous conversions a person means are made: a numeric string for a float field ("3e-4"), a
whole number written as a float or a string for an int field (`steps: 1.0e+3`, `steps: "1e3"`), a
list for a tuple.
"""
from __future__ import annotations

import math
import types
import typing
from dataclasses import MISSING, fields
from functools import cache

from rayshard.plans.errors import ConfigError


def checked_section(section: str, values, kind, extra_keys: frozenset[str] = frozenset(),
                    internal_keys: frozenset[str] = frozenset(), written_as: dict[str, str] | None = None) -> dict:
    """`values` (a config file's mapping for the record `kind`; section "" for the top level) with
    each value checked against its field's type and converted where unambiguous; unknown keys and
    values of the wrong type raise a ConfigError naming `section.key`, or the name the file gave it
    where `written_as` has one (a flat key of before the sections). `extra_keys` pass through
    unchecked; `internal_keys` are fields a file may not set (rayshard fills them itself)."""
    known = sorted((set(field_types(kind)) | set(extra_keys)) - set(internal_keys))
    if not isinstance(values, dict):
        raise ConfigError(section, values, f"must be a mapping, not {_kind_of(values)}",
                          f"write it as `{section}: {{key: value, ...}}` with keys from {known}")
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(section or "config", unknown, f"unknown key(s) {unknown}", f"known keys are {known}")
    prefix, written_as = f"{section}." if section else "", written_as or {}
    return {key: value if key in extra_keys else checked_value(written_as.get(key, prefix + key), value,
                                                                field_types(kind)[key], _defaults(kind).get(key))
            for key, value in values.items()}


def checked_value(name: str, value, annotation, default=None):
    """`value` if it fits `annotation` (int, float, bool, str, their optionals and tuples of
    them), converted where unambiguous; otherwise a ConfigError naming `name` (and, as the
    example of a good value, the field's `default` where it has one)."""
    options = typing.get_args(annotation) if _is_union(annotation) else (annotation,)
    if value is None:
        if type(None) in options:
            return None
        raise ConfigError(name, value, "must be set (the file leaves it empty)", f"give {name} a value or remove the line")
    for option in options:
        if option is type(None):
            continue
        converted = _converted(value, option)
        if converted is not _NO_FIT:
            return converted
    wanted = " or ".join(_describe(option) for option in options if option is not type(None))
    raise ConfigError(name, value, f"must be {wanted}, not {_kind_of(value)}", f"write {name} as {_example(options, value, default)}")


_NO_FIT = object()


def _converted(value, annotation):
    origin = typing.get_origin(annotation)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return _NO_FIT
        item = typing.get_args(annotation)[0]
        items = [_converted(element, item) for element in value]
        return _NO_FIT if any(element is _NO_FIT for element in items) else tuple(items)
    if annotation is bool:
        return value if isinstance(value, bool) else _NO_FIT
    if annotation is int:
        if isinstance(value, bool):
            return _NO_FIT
        if isinstance(value, int):
            return value
        number = _number(value)
        return int(number) if number is not None and number.is_integer() else _NO_FIT
    if annotation is float:
        if isinstance(value, bool):
            return _NO_FIT
        number = _number(value)
        return _NO_FIT if number is None else number
    if annotation is str:
        return value if isinstance(value, str) else _NO_FIT
    return value  # a record or anything richer: its own constructor checks it


def _number(value) -> float | None:
    """A number, or a string that spells one ("3e-4", "1.0e1": PyYAML leaves those as strings)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None  # no NaN learning rate, no endless timeout


def _is_union(annotation) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)


def _describe(annotation) -> str:
    if typing.get_origin(annotation) is tuple:
        item = typing.get_args(annotation)[0]
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(item, _describe(item))
    return {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}.get(
        annotation, getattr(annotation, "__name__", str(annotation)))


def _example(options, value, default) -> str:
    for option in options:
        if typing.get_origin(option) is tuple:
            return "a YAML list, e.g. [1, 2]"
    quoted = f'"{value}"' if isinstance(value, (int, float)) else f'"{default or "name"}"'
    examples = {bool: "true or false", int: f"a whole number, e.g. {default if isinstance(default, int) else 8}",
                float: f"a finite number, e.g. {default if isinstance(default, float) else 0.5:g}",
                str: f"a quoted string, e.g. {quoted}"}
    return next((examples[option] for option in options if option in examples), "the documented form")


def _kind_of(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "infinite"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping", type(None): "empty"}.get(type(value), type(value).__name__)


@cache
def _defaults(kind) -> dict:
    """Field name -> its plain default, where it has one."""
    return {f.name: f.default for f in fields(kind) if f.default is not MISSING}


@cache
def field_types(kind) -> dict:
    """Field name -> resolved annotation (the modules use `from __future__ import annotations`)."""
    resolved = typing.get_type_hints(kind)
    return {f.name: resolved[f.name] for f in fields(kind)}
