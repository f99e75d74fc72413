"""User-facing errors. Each message says what is wrong and how to fix it.

The CLI prints these without a traceback; anything else is a bug and keeps its traceback.
"""


class RayshardError(Exception):
    """Base for errors caused by input (configs, layouts, checkpoints, schedules)."""


class ConfigError(RayshardError, ValueError):
    """A configuration field holds a value that breaks a constraint."""

    def __init__(self, field: str, value, constraint: str, fix: str):
        self.field, self.value, self.constraint, self.fix = field, value, constraint, fix
        super().__init__(f"{field}={value!r}: {constraint}. Fix: {fix}")


class ScheduleError(RayshardError, ValueError):
    """A pipeline schedule cannot be built or is invalid for the given sizes."""


class CheckpointError(RayshardError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""
