"""What `where` and `what` name for `rayshard.checkpoint`: a run as a URL or path, the store being
its parent (`s3://bucket/runs/my-run`: store `s3://bucket/runs`, run `my-run`), optionally
`@STEP`, or a checkpoint directory as the CLI takes it (`.../checkpoints/step-00000020`, or any
directory holding a committed manifest)."""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.cluster.catalog.store import STEP_DIR, CheckpointRef, Store, refuse_credentials
from rayshard.plans.checkpoint.manifest.codec import MANIFEST
from rayshard.plans.errors import ConfigError
from rayshard.plans.run_names import check_run_name


@dataclass(frozen=True)
class RunLocation:
    store: Store
    run: str
    step: int | None  # `@STEP`, when given


def run_location(where: str, field: str = "where") -> RunLocation:
    """The store, run and optional step a run URL or path names (no I/O beyond configuring the
    store's file system)."""
    if not isinstance(where, str) or not where.strip():
        raise ConfigError(field, where, "must name a run as a URL or path", "pass e.g. ./runs/my-run or s3://bucket/runs/my-run")
    refuse_credentials(where, field)
    text = where.strip().rstrip("/")
    parent, _, last = text.rpartition("/")
    if parent.endswith(":/") or parent.endswith(":"):  # s3://bucket: a bucket alone names no run
        raise ConfigError(field, where, "names a bucket or store, not a run inside it",
                          f"add the run's name, e.g. {text}/my-run")
    run, at, step_text = last.partition("@")
    run_dir, _, checkpoints = parent.rpartition("/")
    if checkpoints == "checkpoints" and STEP_DIR.match(run):  # RUN/checkpoints/step-N: immutable once committed
        state = ("a save goes into its run, never into a checkpoint" if field == "where"
                 else "and it holds no manifest: never committed, or damaged")
        raise ConfigError(field, where, f"names a checkpoint directory, not a run; {state}",
                          f"name the run, {run_dir}, or another committed checkpoint" if field != "where"
                          else f"pass the run, {run_dir}, with a new step")
    step = None
    if at:
        if not (step_text.isascii() and step_text.isdigit()):  # not '²' (int() refuses) nor '٢٠' (int() reads 20)
            raise ConfigError(field, where, f"the step after '@' must be a whole number, not {step_text!r}",
                              f"write e.g. {parent + '/' if parent else ''}{run}@20")
        step = int(step_text)
    check_run_name(run, field)
    return RunLocation(Store(parent or "."), run, step)


def resolve_checkpoint(what: str) -> tuple[Store, CheckpointRef]:
    """The committed checkpoint `what` names (a checkpoint directory, RUN_URL@STEP, or RUN_URL for
    its LATEST), and a store to take a reader lease in. Reads the store."""
    if not isinstance(what, str) or not what.strip():
        raise ConfigError("what", what, "must name a run or a checkpoint", "pass e.g. ./runs/my-run, ./runs/my-run@20 "
                          "or a checkpoint directory")
    refuse_credentials(what, "what")
    text = what.strip().rstrip("/")
    if "@" not in text.rpartition("/")[2]:
        store = Store(text)  # configures the file system; the directory may be a checkpoint itself
        if store.fs.exists(f"{store.root}/{MANIFEST}"):
            return store, store.resolve(text)
    location = run_location(text, "what")
    return location.store, location.store.resolve(location.run if location.step is None else f"{location.run}@{location.step}")
