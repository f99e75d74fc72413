"""User-facing errors. Each message says what is wrong and how to fix it.

The CLI prints these without a traceback; anything else is a bug and keeps its traceback.
"""


def first_line(error: BaseException, limit: int = 300) -> str:
    """An error's message for a one-line report: its first line, bounded, or "no detail"."""
    return (str(error).strip().splitlines() or ["no detail"])[0][:limit]


class RayshardError(Exception):
    """Base for errors caused by input (configs, layouts, checkpoints, schedules)."""


class ConfigError(RayshardError, ValueError):
    """A configuration field holds a value that breaks a constraint."""

    def __init__(self, field: str, value, constraint: str, fix: str):
        self.field, self.value, self.constraint, self.fix = field, value, constraint, fix
        super().__init__(f"{field}={value!r}: {constraint}. Fix: {fix}")

    def __reduce__(self):  # raised on a rank, it must reach the driver whole (pickle calls cls(*args))
        return type(self), (self.field, self.value, self.constraint, self.fix), self.__dict__  # marks too


class ScheduleError(RayshardError, ValueError):
    """A pipeline schedule cannot be built or is invalid for the given sizes."""


class CheckpointError(RayshardError):
    """A checkpoint is missing, incomplete, corrupt or does not match the model."""


class StoreUnavailable(RayshardError):
    """The store cannot serve the command at all (its bucket does not exist): exit 3, a storage
    error, though named in one line like an input error."""


class ResourcesUnavailable(RayshardError):
    """The cluster did not grant the ranks' resources (or start their actors) within the bound."""


class StepFailed(RuntimeError):
    """One or more ranks failed a call (or did not answer in time); the message lists each rank's
    own error in the order given: the driver puts the rank that failed first first, since the others
    usually failed because it left. causes: rank -> the exception the rank raised, where it reached
    the driver intact; tracebacks: rank -> the remote traceback text (shown with RAYSHARD_DEBUG=1)."""

    def __init__(self, method: str, failures: dict[int, str], silent: list[int], dead_ranks: list[int] = (),
                 causes: dict[int, BaseException] | None = None, tracebacks: dict[int, str] | None = None,
                 waited_s: float | None = None):
        self.method, self.failures, self.silent, self.dead_ranks = method, failures, list(silent), sorted(dead_ranks)
        self.waited_s = waited_s
        self.causes, self.tracebacks = dict(causes or {}), dict(tracebacks or {})
        if failures:
            lines = [f"{method} failed on {len(failures)} rank(s):"]
        else:
            lines = [f"{method}: no rank answered within {waited_s:g} s" if waited_s is not None else f"{method} failed:"]
        lines += [f"  rank {rank}: {message}" for rank, message in failures.items()]  # the first to fail first
        if self.silent:
            lines.append(f"  no answer yet from rank(s) {self.silent}")
        super().__init__("\n".join(lines))

    def first_cause(self, kinds: tuple[type[BaseException], ...]) -> tuple[int, BaseException] | None:
        """The first rank (in failure order, then by number) whose own error is one of `kinds`."""
        for rank in [r for r in self.failures if r in self.causes] + sorted(set(self.causes) - set(self.failures)):
            if isinstance(self.causes[rank], kinds):
                return rank, self.causes[rank]
        return None


def from_rank(error: BaseException, rank: int, remote_traceback: str = "") -> BaseException:
    """Mark an exception a rank raised (unwrapped from Ray's RayTaskError) with its rank, so the
    CLI can prefix its message with it and show the remote traceback on request."""
    error.rayshard_rank = rank
    error.remote_traceback = remote_traceback
    return error


def rank_of(error: BaseException) -> int | None:
    return getattr(error, "rayshard_rank", None)
