"""Prove that a resume loaded exactly what the checkpoint holds.

With `verify_resume` on, right after the ranks load a checkpoint (possibly resharded onto another
layout) and before the first resumed step, every rank writes its share of the loaded state to a
side location, exactly as a save would. The per-tensor digests of that side copy are
layout-independent (cluster/checkpoint/digest.py), so they must equal the loaded checkpoint's digests tensor
for tensor — model parameters, optimizer moments and counters. A mismatch stops the run before it
trains on wrong state. Each check is appended to `<run>/resume-checks.jsonl` and the side copy is
deleted afterwards.

It costs one save and two streaming digests per resume, so it is opt-in (`--verify-resume`):
elastic tests use it to show that every recovery resumed the last committed state bit for bit.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from rayshard.actors.checkpoint.stored import StoredCheckpoint
from rayshard.cluster.checkpoint.digest import checkpoint_digest, digest_checkpoint
from rayshard.cluster.run.json_lines import json_records
from rayshard.cluster.catalog.store import Store, step_dirname
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.errors import CheckpointError
from rayshard.plans.checkpoint.reshard import check_chunks_disjoint_and_complete

CHECKS_FILE = "resume-checks.jsonl"


@dataclass(frozen=True)
class ResumeCheck:
    """One line of `<run>/resume-checks.jsonl`."""
    step: int
    checkpoint: str
    layout: str
    tensors: int
    digest: str  # the checkpoint digest (cluster/checkpoint/digest.py)
    equal: bool
    time: float


def verify_resumed_state(group, store: Store, run: str, step: int, checkpoint_url: str, layout: str) -> ResumeCheck:
    """Save what the ranks hold now to a side copy and compare its digests with checkpoint_url's."""
    side_path = f"{store.root}/{run}/resume-checks/{step_dirname(step)}-{store.new_attempt()}"
    side_url = store._url(side_path)
    files = [f"rank-{rank:05d}.safetensors" for rank in range(len(group.actors))]
    try:
        chunks = [Chunk.from_row(row) for rows in group.call_each("save_shard", [(side_url, f) for f in files])
                  for row in rows]
        check_chunks_disjoint_and_complete(chunks)
        held = {(d.name, d.kind): d for d in digest_checkpoint(StoredCheckpoint(side_url, chunks, {}))}
        stored = {(d.name, d.kind): d for d in digest_checkpoint(checkpoint_url)}
    finally:
        if store.fs.exists(side_path):
            store.fs.rm(side_path, recursive=True)
    differing = sorted(f"{kind} {name}" for key in held.keys() | stored.keys()
                       for name, kind in [key] if held.get(key) != stored.get(key))
    record = ResumeCheck(step, checkpoint_url, layout, len(stored), checkpoint_digest(list(stored.values())),
                         not differing, time.time())
    _append(store, run, record)
    if differing:
        raise CheckpointError(
            f"the state loaded from {checkpoint_url} onto layout {layout} differs from the checkpoint in "
            f"{len(differing)} tensors: {', '.join(differing[:10])}{' ...' if len(differing) > 10 else ''}. "
            "The load path is wrong for this layout pair; resume on the checkpoint's own layout meanwhile "
            "and report the pair")
    return record


def resume_checks(store: Store, run: str) -> list[dict]:
    return json_records(store.read_text(f"{run}/{CHECKS_FILE}") or "", f"{store.url}/{run}/{CHECKS_FILE}")


def _append(store: Store, run: str, record: ResumeCheck) -> None:
    lines = [json.dumps(r, sort_keys=True) for r in resume_checks(store, run) + [asdict(record)]]
    store.write_text(f"{run}/{CHECKS_FILE}", "\n".join(lines) + "\n")
