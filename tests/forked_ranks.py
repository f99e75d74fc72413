"""Run a function as the ranks of a real gloo process group, in processes forked from the test.

Forked, not spawned: a spawned child imports torch again, ~4 s a process on a loaded 2-core
machine (a 4-rank test spent 17 s of its 18 there); a forked one starts with the parent's torch
already loaded. The children use only torch and gloo, never the parent's Ray connection, and leave
through os._exit, so nothing of Ray runs in them."""
from __future__ import annotations

from typing import Callable

import torch.multiprocessing as mp

from tests.free_port import free_port


def run_ranks(function: Callable, world_size: int, *args) -> dict:
    """Calls function(rank, init_method, world_size, results, *args) in world_size forked
    processes; returns what each rank stored in `results` (a Manager dict: rank -> its answer)."""
    with mp.Manager() as manager:
        results = manager.dict()
        # start_processes calls function(rank, *args).
        mp.start_processes(function, args=(f"tcp://127.0.0.1:{free_port()}", world_size, results, *args),
                           nprocs=world_size, start_method="fork")
        return dict(results)
