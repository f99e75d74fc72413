"""The history a run's metrics.jsonl tells, read from lines that are only ever appended.

Every attempt of a run appends its step records to the same file and never rewrites it (two
processes may interleave their appends; nothing is lost). A resumed attempt starts again after
its checkpoint, so the file can hold a step more than once: the later record is the one of the
current timeline, and a step logged again abandons every record past it (the steps an earlier
attempt took beyond the checkpoint it was resumed from). The result holds each step once, in
order, as one uninterrupted run would have written it.
"""
from __future__ import annotations


def current_timeline(records: list[dict]) -> list[dict]:
    """The records of the timeline the run is on now, one per step, in step order; records
    without an integer step (foreign lines) are left out."""
    by_step: dict[int, dict] = {}
    highest = None
    for record in records:
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        if highest is not None and step <= highest:  # a resumed attempt: the old steps past it are abandoned
            by_step = {logged: kept for logged, kept in by_step.items() if logged < step}
        by_step[step] = record
        highest = step
    return [by_step[step] for step in sorted(by_step)]
