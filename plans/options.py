"""How a config field is set from the command line, declared once beside the field.

A config section is a frozen dataclass; each of its fields says in `dataclasses.field(metadata=...)`
how a person sets it: `option(...)` gives its flag (name, help, metavar and, for a closed set of
values, the choices), `file_only(...)` marks a field no flag sets, on purpose (its value comes from
the config file, or its default), and `section(...)` nests a section. The CLI builds its arguments
from these (cluster/cli/config_flags.py): an option is written once, as its field, its type (the
annotation), its help and its constraint.

Range checks are not flags' business: each section's `validate` holds them, because many need
another section (a batch must divide over dp*fsdp), and one check then serves a file's value and
a flag's alike, with the same fix. Pure data; here rather than in plans/config/ because the layout
section (plans/layout/parallel_layout.py) declares its flags too, and the config imports it.
"""
from __future__ import annotations

import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from functools import cache

FLAG, FILE_ONLY, SECTION = "flag", "file_only", "section"


@dataclass(frozen=True)
class Flag:
    """One command-line flag. name: None is the field's name with dashes (`seq_len` -> --seq-len).
    reads_file: the flag names a file whose contents fill the field (--schedule-csv FILE)."""

    help: str
    name: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    reads_file: bool = False


@dataclass(frozen=True)
class Section:
    """A field holding a whole section; `about` heads its flags in `--help`."""

    kind: type
    about: str


def option(default=MISSING, *, help: str, flag: str | None = None, metavar: str | None = None,
           choices: tuple[str, ...] = (), reads_file: bool = False, default_factory=MISSING) -> Field:
    """A field with a command-line flag."""
    return field(default=default, default_factory=default_factory,
                 metadata={FLAG: Flag(help, flag, metavar, tuple(choices), reads_file)})


def file_only(default=MISSING, *, default_factory=MISSING) -> Field:
    """A field set only in the config file: no flag, deliberately (tuning knobs a run rarely changes)."""
    return field(default=default, default_factory=default_factory, metadata={FILE_ONLY: True})


def section(kind: type, about: str) -> Field:
    """A field holding a section (a frozen dataclass of its own fields), its defaults by default."""
    return field(default_factory=kind, metadata={SECTION: Section(kind, about)})


@dataclass(frozen=True)
class Setting:
    """One leaf field of a config: where it sits (`pipeline.microbatches`, or `steps` at the top
    level) and how it is set."""

    path: str
    name: str
    annotation: object
    flag: Flag | None
    section: str  # the dotted path of the section holding it ("" for the top level)

    @property
    def flag_name(self) -> str | None:
        if self.flag is None:
            return None
        return self.flag.name or "--" + self.name.replace("_", "-")


@cache
def settings(kind: type, prefix: str = "") -> tuple[Setting, ...]:
    """Every leaf field of the config `kind`, sections walked in field order. A field that is
    neither an option, file-only nor a section is an error: each must say how it is set."""
    found = []
    hints = typing.get_type_hints(kind)
    for item in fields(kind):
        path = f"{prefix}{item.name}"
        if SECTION in item.metadata:
            found += settings(item.metadata[SECTION].kind, path + ".")
        elif FLAG in item.metadata or item.metadata.get(FILE_ONLY):
            found.append(Setting(path, item.name, hints[item.name], item.metadata.get(FLAG), prefix.rstrip(".")))
        else:
            raise TypeError(f"{kind.__name__}.{item.name} says neither its flag nor that it is file-only: "
                            "declare it with option(...), file_only(...) or section(...)")
    return tuple(found)


@cache
def sections(kind: type, prefix: str = "") -> tuple[tuple[str, Section], ...]:
    """(dotted path, Section) of every section of the config `kind`, nested ones after their parent."""
    found = []
    for item in fields(kind):
        if SECTION in item.metadata:
            path = f"{prefix}{item.name}"
            found.append((path, item.metadata[SECTION]))
            found += sections(item.metadata[SECTION].kind, path + ".")
    return tuple(found)
