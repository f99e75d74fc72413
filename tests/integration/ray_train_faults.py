"""Faults injected into examples/ray_train's train function from outside it (the example stays
the code a user copies). Imported by Ray Train's workers by reference, so it lives in a module."""
from __future__ import annotations

import os
import signal

from examples.ray_train.train import train_func


def train_func_dying_in_save(config: dict) -> None:
    """The example's loop, but worker `die_rank` writes its share of save number `die_in_save`
    (1-based) and is then killed -9, before the first worker can commit: a real mid-save death.
    It first waits for Ray Train to have registered the reports before it (they are processed
    in the background), so the test knows which checkpoints Ray Train must hold."""
    import ray.train
    import rayshard.cluster.api.checkpoint as api

    if ray.train.get_context().get_world_rank() == config["die_rank"]:
        real, saves = api._write_share, []

        def write_then_die(share, snapshot):
            written = real(share, snapshot)
            saves.append(share.url)
            if len(saves) == config["die_in_save"]:
                ray.train.get_all_reported_checkpoints(timeout_s=120)
                os.kill(os.getpid(), signal.SIGKILL)
            return written

        api._write_share = write_then_die
    train_func(config)
