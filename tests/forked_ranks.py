"""Run a function as the ranks of a real gloo process group, in processes forked from the test.

Forked, not spawned: a spawned child imports torch again, ~4 s a process on a loaded 2-core
machine (a 4-rank test spent 17 s of its 18 there); a forked one starts with the parent's torch
already loaded. The children use only torch and gloo, never the parent's Ray connection, and leave
through os._exit, so nothing of Ray runs in them.

The objects the children inherit are frozen out of their garbage collector (`gc.freeze` in the
parent, just for the fork, as Python's docs advise for forking): a child's collection otherwise
walked the test process's whole heap and ran finalizers of objects it merely inherited (a Ray
handle's, a process group's), which could block forever; two tp ranks were once found in
"Garbage-collecting" inside a DTensor op, four minutes into a 6-second test.

The wait is bounded: ranks still running at the deadline print every thread's stack (faulthandler,
on SIGUSR1) and are killed, and the test fails naming the function, rather than waiting out
pytest's timeout with nothing to show where the children stood."""
from __future__ import annotations

import faulthandler
import gc
import os
import signal
import time
from typing import Callable

import torch
import torch.multiprocessing as mp

from tests.free_port import free_port

DEADLINE_S = 240.0


def _rank_with_stack_dumps(rank: int, function: Callable, *args) -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # One intra-op thread, as a rank actor runs: a child forked after the test process used its
    # OpenMP pool inherits that pool's state but not its threads, and its first parallel kernel
    # then waited for them forever (fused AdamW, after tests/unit/test_house.py in one session).
    torch.set_num_threads(1)
    function(rank, *args)


def run_ranks(function: Callable, world_size: int, *args, deadline_s: float = DEADLINE_S) -> dict:
    """Calls function(rank, init_method, world_size, results, *args) in world_size forked
    processes; returns what each rank stored in `results` (a Manager dict: rank -> its answer)."""
    with mp.Manager() as manager:
        results = manager.dict()
        # start_processes calls _rank_with_stack_dumps(rank, *args).
        gc.freeze()
        try:
            context = mp.start_processes(_rank_with_stack_dumps,
                                         args=(function, f"tcp://127.0.0.1:{free_port()}", world_size, results, *args),
                                         nprocs=world_size, start_method="fork", join=False)
        finally:
            gc.unfreeze()
        deadline = time.monotonic() + deadline_s
        while not context.join(timeout=1.0):  # raises as soon as a rank fails
            if time.monotonic() > deadline:
                running = {rank: process for rank, process in enumerate(context.processes) if process.is_alive()}
                for process in running.values():
                    os.kill(process.pid, signal.SIGUSR1)
                time.sleep(2.0)  # let them write their stacks to stderr
                for process in running.values():
                    process.kill()
                    process.join(timeout=10.0)  # reaped: no zombie outlives the test
                raise TimeoutError(f"{function.__name__}: ranks {sorted(running)} still running after {deadline_s:.0f} s "
                                   "(their stacks are on stderr above)")
        return dict(results)
