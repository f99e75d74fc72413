"""The run's JSON-lines logs (metrics.jsonl, resume-checks.jsonl) read back tolerantly.

They are records of what happened, not state: a line cut short by a crash mid-write, or edited
into nonsense, must not stop a resume or a picture. Lines that are not JSON objects are skipped,
and the file and line numbers are named once on stderr so the damage is not silent.
"""
from __future__ import annotations

import json
import sys


def json_records(text: str, where: str) -> list[dict]:
    """Each line of `text` that is a JSON object, in order; the others are reported and skipped."""
    records, skipped = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            skipped.append(number)
    if skipped:
        shown = ", ".join(map(str, skipped[:5])) + (" ..." if len(skipped) > 5 else "")
        print(f"rayshard: warning: {where}: skipped {len(skipped)} line(s) that are not JSON records (line {shown})",
              file=sys.stderr)
    return records
