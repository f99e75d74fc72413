"""Where a thread of this process is now, in one line: for a rank that did not answer its
driver within a bound (cluster/run/rank_pool.py names it as lost, and says where it was stuck,
so a hang in a collective can be found from the recovery's own line)."""
from __future__ import annotations

import os
import sys
import traceback

# Frames of our own code are named relative to the package; others by their last two path parts.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAYERS = ("actors", "cluster", "plans", "storage", "rayshard")


def where_thread_is(thread_id: int) -> str:
    """The thread's innermost frame and the innermost one in rayshard's own code, e.g.
    `wait (torch/distributed/distributed_c10d.py:2871) from clip_grad_norm
    (actors/parallel/gradient_norm.py:60)`; "" if the thread has ended."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return ""
    stack = traceback.extract_stack(frame)
    innermost = stack[-1]
    ours = next((entry for entry in reversed(stack[:-1]) if _is_ours(entry.filename)), None)
    line = _describe(innermost)
    return line + (f" from {_describe(ours)}" if ours is not None else "")


def _is_ours(filename: str) -> bool:
    relative = os.path.relpath(os.path.abspath(filename), _PACKAGE_ROOT)
    return relative.split(os.sep)[0] in _LAYERS


def _describe(entry: traceback.FrameSummary) -> str:
    path = os.path.abspath(entry.filename)
    shown = os.path.relpath(path, _PACKAGE_ROOT) if _is_ours(path) else "/".join(path.split(os.sep)[-2:])
    return f"{entry.name} ({shown}:{entry.lineno})"
