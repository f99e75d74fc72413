"""The flat keys a config file had before the sections, still read: each moves to its section.

`precision: bf16` means `numerics: {precision: bf16}`. A file may mix both forms, but not give
one setting twice. Messages about a moved value name the key as the file wrote it (the person
looks for `ckpt_every`, not `checkpoint.every`), and the CLI prints one line listing the moves
(`deprecation_note`), so old files keep working while their owners learn the new form.
"""
from __future__ import annotations

from rayshard.plans.errors import ConfigError

# Flat key -> (section, key in it).
FLAT_KEYS = {
    "model_preset": ("model", "preset"),
    "world_size": ("resources", "world_size"),
    "cpus_per_rank": ("resources", "cpus_per_rank"),
    "gpus_per_rank": ("resources", "gpus_per_rank"),
    "start_timeout_s": ("resources", "start_timeout_s"),
    "call_timeout_s": ("resources", "call_timeout_s"),
    "collective_timeout_s": ("resources", "collective_timeout_s"),
    "schedule": ("pipeline", "schedule"),
    "microbatches": ("pipeline", "microbatches"),
    "stage_layout": ("pipeline", "stage_layout"),
    "schedule_csv": ("pipeline", "schedule_csv"),
    "pipeline_timeout_s": ("pipeline", "timeout_s"),
    "ckpt_every": ("checkpoint", "every"),
    "resume": ("checkpoint", "resume"),
    "verify_resume": ("checkpoint", "verify_resume"),
    "precision": ("numerics", "precision"),
    "ac": ("numerics", "ac"),
    "compile": ("numerics", "compile"),
    "sequence_parallel": ("numerics", "sequence_parallel"),
    "tensorboard": ("metrics", "tensorboard"),
    "wandb_project": ("metrics", "wandb_project"),
}


def flat_keys_in(data: dict) -> list[str]:
    """The flat keys a config file's mapping uses, in the file's order."""
    return [key for key in data if key in FLAT_KEYS]


def deprecation_note(keys: list[str]) -> str:
    """One line naming each flat key's sectioned place."""
    moves = ", ".join(f"{key} -> {'.'.join(FLAT_KEYS[key])}" for key in keys)
    return (f"flat config keys are deprecated: {moves}; write each inside its section, e.g. "
            f"`{FLAT_KEYS[keys[0]][0]}: {{{FLAT_KEYS[keys[0]][1]}: ...}}` (configs/demo.yaml shows every section)")


def sectioned(data: dict) -> tuple[dict, dict[str, dict[str, str]]]:
    """`data` with each flat key moved into its section, and section -> {key: the name the file
    gave it} for the moved ones. A section that is not a mapping is left for its own check to
    name; a setting given both ways is an error."""
    data, written_as = dict(data), {}
    if isinstance(data.get("model"), str):  # `model: small`, a preset's name alone
        data["model"] = {"preset": data["model"]}
    for key in flat_keys_in(data):
        section, name = FLAT_KEYS[key]
        values = data.get(section)
        if values is None:
            values = {}
        if not isinstance(values, dict):
            continue
        if name in values:
            raise ConfigError(key, data[key], f"is set twice: as `{key}` and as `{section}.{name}`",
                              f"keep only {section}.{name}")
        data[section] = {**values, name: data.pop(key)}
        written_as.setdefault(section, {})[name] = key
    return data, written_as
