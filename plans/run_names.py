"""Run names and checkpoint references: which text names a run inside a store.

A run name becomes a directory under the store (`{store}/{run}/...`), so anything that could
leave it — '/', '..', an absolute path, a scheme, an empty name — is refused wherever a name
enters: `train --run`, `--run` and `--reference` of the catalog commands, the RUN of a RUN[@STEP]
reference, and the library calls behind them (decision 99). Pure: text in, verdict out.
"""
from __future__ import annotations

import re

from rayshard.plans.errors import ConfigError

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RULE = ("1-128 letters, digits, '.', '_' or '-', starting with a letter or digit "
        "(it names a directory inside the store: no '/', '..', scheme or absolute path)")
FIX = "pick a name like my-run-01; address a checkpoint outside the store by its URL or path instead"


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot name a run (the rule it breaks), or None when it can."""
    if isinstance(name, str) and name.lower() == "latest":
        # A run so named could be written but never read: `latest` in a reference means the store's newest checkpoint.
        return "reserved: in a checkpoint reference `latest` means the newest checkpoint of the store"
    return None if isinstance(name, str) and RUN_NAME.match(name) else f"not a run name: {RULE}"


def check_run_name(name: str, field: str = "--run") -> str:
    """`name` itself, or a ConfigError naming the field, the name and the rule."""
    problem = run_name_problem(name)
    if problem:
        raise ConfigError(field, name, problem, FIX)
    return name


def is_location(ref: str) -> bool:
    """A checkpoint reference that is a URL or a path (read where it points), not RUN[@STEP]
    within a store."""
    return "://" in ref or ref.startswith(("/", "./", "../")) or "/" in ref.split("@")[0]


def check_checkpoint_ref(ref: str, field: str = "CKPT") -> str:
    """`latest`, RUN or RUN@STEP whose RUN is a run name, or a URL/path; else a ConfigError."""
    if is_location(ref):
        return ref
    run = ref.partition("@")[0]
    if run != "latest":
        problem = run_name_problem(run)
        if problem:
            raise ConfigError(field, ref, f"its RUN {run!r} is {problem}",
                              "name a run of --store as RUN or RUN@STEP, or pass the checkpoint's URL or path")
    return ref
