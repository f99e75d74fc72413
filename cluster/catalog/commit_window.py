"""A run's own checkpoints that LATEST does not name yet: adopted, or refused in one line.

A commit writes the manifest (create-only), then moves LATEST. A trainer that dies between the
two leaves a whole checkpoint that LATEST does not name. Resuming from LATEST would retrain those
steps and then meet the existing manifest at the next commit ("another writer committed this
checkpoint first", with no other writer). Holding the run's writer lease, the resuming trainer
knows no live writer is mid-commit, so a committed step past LATEST is a dead attempt's: if it
descends from LATEST's checkpoint (its manifest names this run and, parent by parent, LATEST's
step), it is adopted: LATEST moves to it by compare-and-swap and training continues from there.
One that does not descend from it (copied in from another run, or of a writer that ignored the
lease), or whose files are damaged, is refused; nothing is deleted (docs/decisions.md 96).
"""
from __future__ import annotations

import sys

from rayshard.storage.backends.protocol import PreconditionFailed
from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.catalog.catalog import Catalog
from rayshard.cluster.catalog.store import Store, step_dirname, step_named
from rayshard.plans.errors import CheckpointError


def _descends(metadata: dict, run: str, parent_step: int) -> bool:
    parent = str(metadata.get("parent") or "").rstrip("/")
    return metadata.get("run") == run and parent.endswith(f"/{run}/checkpoints/{step_dirname(parent_step)}")


def adopt_unnamed_commits(store: Store, run: str) -> int | None:
    """Move LATEST to the newest committed step of the run's own lineage past it, and say so;
    the step adopted, or None when LATEST already names the newest (or there is no LATEST)."""
    path = f"{store.root}/{run}/LATEST"
    data, version = store.backend.read_versioned(path)  # one read: the swap below is from this version
    latest, committed = step_named(data), store.committed_steps(run)
    if latest is None or latest not in committed:
        return None  # Store.resolve takes the newest committed step then (decision 88)
    adopted = latest
    newer = [s for s in committed if s > latest]
    if newer:  # rare (a crash in the window): worth one listing to never name a damaged checkpoint
        damaged = {e.step: e.status for e in Catalog(store).checkpoints(run) if e.step in newer and not e.whole}
    for step in newer:
        if step in damaged:
            raise CheckpointError(
                f"run {run!r}: step {step} is committed past LATEST (step {latest}) but damaged ({damaged[step]}), "
                f"so LATEST stays on step {latest}. Fix: restore its files and resubmit, or branch from the last "
                f"whole one with --resume {run}@{latest} --run NEW_NAME (`rayshard ckpt verify {run}@{step}` "
                "says what is wrong)")
        metadata = read_manifest(store.checkpoint_url(run, step))[1]
        if not _descends(metadata, run, adopted):
            raise CheckpointError(
                f"run {run!r}: step {step} is committed past LATEST (step {latest}) but does not descend from step "
                f"{adopted} (its manifest names run {metadata.get('run')!r}, parent {metadata.get('parent')!r}), so it "
                f"is not this run's own unfinished commit. Fix: resume it on purpose with --resume {run}@{step}, "
                "or train under another --run name")
        adopted = step
    if adopted == latest:
        return None
    try:
        store.backend.replace_if(path, step_dirname(adopted).encode(), version)
    except PreconditionFailed:
        raise CheckpointError(f"run {run!r}: LATEST changed while adopting step {adopted}: another trainer is "
                              "writing this run. Fix: run one trainer per run") from None
    print(f"rayshard: run {run!r}: step {adopted} was committed but LATEST still named step {latest} (a trainer "
          f"stopped between the manifest and the LATEST move); it descends from step {latest}, so LATEST now names "
          "it and training continues from there", file=sys.stderr, flush=True)
    return adopted


def refuse_rewrites(store: Store, run: str, start_step: int) -> None:
    """A resume into the run at an older step than its newest commit would leave the newer ones
    behind a LATEST that no longer descends to them (and commit their steps again); manifests are
    never overwritten, so refuse before training: a branch goes into a new run."""
    newer = [s for s in store.committed_steps(run) if s > start_step]
    if newer:
        raise CheckpointError(
            f"run {run!r} already has committed checkpoints past step {start_step} (steps {newer}); training it "
            f"again from there would fork the run and commit its steps twice; checkpoints are never overwritten. "
            f"Fix: resume from the newest (--resume latest), or branch into a new run (--resume {run}@{start_step} "
            "--run NEW_NAME)")
