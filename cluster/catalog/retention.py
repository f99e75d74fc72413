"""`ckpt gc`: keep the newest whole checkpoints of each run, remove the rest and every leftover.

What a run keeps (decision 100): its newest whole checkpoint, whatever --keep says, and up to
--keep whole ones in all; a damaged checkpoint (a shard missing or shorter than its manifest
says, an unreadable manifest) is never counted as kept, and is removed only where a whole
checkpoint newer than it stays, so gc never leaves a run with nothing to resume from. Never
removed either: the checkpoint LATEST names, checkpoints with an unexpired reader lease, and
anything written within the grace period (a leftover that young may be a save in progress, a
pending multipart upload may still complete). "Whole" is the catalog's cheap check: one listing
of the run and each manifest, no shard read. A checkpoint is removed manifest first, so it stops
being visible before any of its shards go; a gc that dies half way leaves only leftovers, which
the next gc collects.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.catalog import leases
from rayshard.cluster.catalog.catalog import Catalog, CheckpointEntry
from rayshard.cluster.catalog.store import Store
from rayshard.plans.checkpoint.manifest.codec import MANIFEST
from rayshard.plans.checkpoint.manifest.object_keys import escape_reason

DEFAULT_GRACE_S = 3600.0


@dataclass(frozen=True)
class Verdict:
    """What gc does with one committed checkpoint, and why (`ckpt gc --dry-run` prints each)."""
    run: str
    step: int
    url: str
    remove: bool
    why: str


@dataclass
class GcReport:
    removed_checkpoints: list[str] = field(default_factory=list)
    removed_leftovers: list[str] = field(default_factory=list)
    aborted_uploads: list[str] = field(default_factory=list)
    removed_leases: list[str] = field(default_factory=list)
    kept: list[tuple[str, str]] = field(default_factory=list)  # (url or path, why)
    checkpoints: list[Verdict] = field(default_factory=list)  # every committed checkpoint, kept or removed
    freed_bytes: int = 0


def collect(store: Store, keep: int, run: str | None = None, grace_s: float = DEFAULT_GRACE_S,
            dry_run: bool = False, now: float | None = None) -> GcReport:
    now = time.time() if now is None else now
    catalog, fs, report = Catalog(store), store.fs, GcReport()
    for name in catalog.runs_named(run):
        _collect_checkpoints(store, catalog, name, keep, now, dry_run, report)
        for leftover in catalog.leftovers(name):
            if now - leftover.newest_unix < grace_s:
                report.kept.append((leftover.path, f"{leftover.kind} written {now - leftover.newest_unix:.0f}s ago, "
                                                   f"within the {grace_s:.0f}s grace period (maybe a save in progress)"))
                continue
            if not dry_run:
                fs.rm(leftover.path, recursive=True)
                store.backend.remove_empty_directory(leftover.path.rsplit("/", 1)[0])
            report.removed_leftovers.append(leftover.path)
            report.freed_bytes += leftover.size_bytes
        for held in leases.all_leases(store, name).values():
            for lease in held:
                if lease.expires_unix <= now:
                    if not dry_run:
                        fs.rm_file(lease.path)
                    report.removed_leases.append(lease.path)
    for upload in store.backend.pending_uploads(store.root if run is None else store.run_path(run)):
        if now - upload.initiated_unix < grace_s:
            report.kept.append((upload.path, "multipart upload started within the grace period"))
            continue
        if not dry_run:
            store.backend.abort_upload(upload)
        report.aborted_uploads.append(upload.path)
    return report


def _collect_checkpoints(store: Store, catalog: Catalog, run: str, keep: int, now: float, dry_run: bool,
                         report: GcReport) -> None:
    entries = catalog.checkpoints(run)
    for verdict in verdicts(entries, keep, leases.active(store, run, now)):
        report.checkpoints.append(verdict)
        if not verdict.remove:
            report.kept.append((verdict.url, verdict.why))
            continue
        entry = next(e for e in entries if e.step == verdict.step)
        if not _remove_checkpoint(store, entry, dry_run):
            report.kept.append((verdict.url, "being read (a reader lease taken while gc removed it: put back)"))
            continue
        report.removed_checkpoints.append(entry.url)
        report.freed_bytes += entry.size_bytes


def verdicts(entries: list[CheckpointEntry], keep: int, leased: dict[int, list]) -> list[Verdict]:
    """Keep or remove, and why, for each committed checkpoint of one run (oldest first)."""
    whole = sorted((e.step for e in entries if e.whole), reverse=True)
    kept_whole = set(whole[:max(keep, 1)])  # the newest whole one stays whatever --keep says
    newest_whole = whole[0] if whole else None
    found = []
    for entry in sorted(entries, key=lambda e: e.step):
        damage = "" if entry.whole else f"damaged ({entry.status}), "
        if entry.latest:
            why = f"{damage}LATEST names it"
        elif entry.step in kept_whole:
            why = ("the newest whole checkpoint of its run (kept whatever --keep says)" if entry.step == newest_whole
                   else f"one of the {keep} newest whole checkpoints (--keep {keep})")
        elif leased.get(entry.step):
            why = f"{damage}being read ({len(leased[entry.step])} reader lease(s))"
        elif not entry.whole and (newest_whole is None or newest_whole < entry.step):
            why = (f"{damage}not counted as kept, and no whole checkpoint is newer: left for repair "
                   "(`rayshard ckpt verify` names what is wrong)")
        else:
            reason = (f"{damage}a whole checkpoint newer than it is kept" if damage else
                      f"older than the {len(kept_whole)} newest whole checkpoint(s) kept (--keep {keep})")
            found.append(Verdict(entry.run, entry.step, entry.url, True, reason))
            continue
        found.append(Verdict(entry.run, entry.step, entry.url, False, why))
    return found


def _remove_checkpoint(store: Store, entry, dry_run: bool) -> bool:
    """Remove a committed checkpoint, manifest first; False when a reader took a lease on it
    meanwhile, and the manifest is put back. The reader writes its lease, then checks that the
    manifest exists; gc removes the manifest, then checks for leases: whichever goes second sees
    the other, so a reader that found the manifest always has its lease seen here (the leases
    listed before the removal began are older than a gc that removes many checkpoints in turn)."""
    directory = f"{store.root}/{entry.run}/checkpoints/{entry.url.rsplit('/', 1)[-1]}"
    manifest_path = f"{directory}/{MANIFEST}"
    manifest = store.fs.cat_file(manifest_path)  # read once: decoded here, and put back if a reader came
    try:
        chunks, _ = read_manifest(entry.url, manifest)
        attempts = sorted({c.file.split("/", 1)[0] for c in chunks if not object_store_escape(c.file)})
    except Exception:  # an unreadable manifest, or one naming keys outside it: its directory goes whole
        attempts = None
    if dry_run:
        return True
    store.fs.rm_file(manifest_path)  # invisible first: no reader can start on it after this
    if leases.held(store, entry.run, entry.step):
        store.backend.create_only(manifest_path, manifest)
        return False
    if attempts is None:
        with contextlib.suppress(FileNotFoundError):  # on S3 a manifest-only directory is gone already
            store.fs.rm(directory, recursive=True)
        return True
    for attempt in attempts:
        path = f"{directory}/{attempt}"
        if store.fs.exists(path):
            store.fs.rm(path, recursive=True)
    store.backend.remove_empty_directory(directory)
    return True


def object_store_escape(key: str) -> bool:
    return escape_reason(key) is not None
