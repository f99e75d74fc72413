"""A rank actor reused by the next attempt forgets the previous attempt's background saves
(decision 228). A snapshot of the same step has the same URL in both attempts, and the driver's
`save_finished` (its own concurrency group) can run before `stage_save` registers the new save: it
answered with the old save's status, whose chunks named files the resume had removed, and the
driver committed them (bench/recovery.py found it once commits listed their files)."""
from __future__ import annotations

import types

import ray

URL = "rayshard-snapshot://snapshots/r/checkpoints/step-00000045"


def test_a_reused_rank_answers_nothing_of_the_previous_attempts_saves(rank_pool):
    actor = rank_pool[-1]

    def keep_a_previous_attempts_save(self) -> None:  # on the actor (a local function travels by value)
        done = {"done": True, "chunks": "the previous attempt's", "error": None}
        self.background_saves[URL] = types.SimpleNamespace(status=lambda wait=False, timeout_s=None: done)

    ray.get(actor.__ray_call__.remote(keep_a_previous_attempts_save), timeout=60)
    assert ray.get(actor.save_finished.remote(URL, 1.0), timeout=60)["chunks"] == "the previous attempt's"
    ray.get(actor.shutdown.remote(), timeout=60)  # what `setup` does first on a reused actor
    assert ray.get(actor.save_finished.remote(URL, 0.5), timeout=60) is None
    assert ray.get(actor.__ray_call__.remote(lambda self: dict(self.background_saves)), timeout=60) == {}
