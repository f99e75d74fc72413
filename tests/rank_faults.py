"""Rank faults a test installs from outside: a rank that stalls, or whose process dies, in a step.

The product knows nothing of faults; it only applies the step-runner wrapper named by
`RAYSHARD_WRAP_RUNNER` (`actors/rank.py`). `fault_env` gives the environment variables that name
`install_from_environment` and describe the fault; pass them to the actors (Ray's runtime_env
env_vars, as `ranks_with_fault` does, or the environment of a process that starts Ray).
"""
from __future__ import annotations

import contextlib
import json
import os
import time

from rayshard.actors.rank import WRAP_RUNNER_ENV, RankActor

FAULT_ENV = "RAYSHARD_TEST_RANK_FAULT"
KINDS = ("stall", "exit", "raise")


def fault_env(kind: str, rank: int, at_step: int = 0, seconds: float = 0.0) -> dict[str, str]:
    """kind "stall": `rank` sleeps `seconds` before step `at_step`'s forward/backward (counted from
    this trainer's first step); kind "exit": its process exits there, as a rank killed mid-step
    would, while its peers wait on it in transfers and collectives; kind "raise": it raises an
    error of its own there (a bug, a bad batch), its process alive."""
    if kind not in KINDS:
        raise ValueError(f"unknown rank fault {kind!r}; use one of {KINDS}")
    fault = {"kind": kind, "rank": rank, "at_step": at_step, "seconds": seconds}
    return {WRAP_RUNNER_ENV: f"{__name__}:install_from_environment", FAULT_ENV: json.dumps(fault)}


def install_from_environment(runner, rank: int):
    """The WrapRunner the actors apply: the fault's rank gets a FaultyRunner, the others their own."""
    fault = json.loads(os.environ[FAULT_ENV])
    if fault["rank"] != rank:
        return runner
    return FaultyRunner(runner, fault["kind"], fault["at_step"], fault["seconds"])


class FaultyRunner:
    """A step runner that misbehaves once, at the start of one step, and otherwise is `runner`."""

    def __init__(self, runner, kind: str, at_step: int, seconds: float):
        self.runner, self.kind, self.at_step, self.seconds = runner, kind, at_step, seconds
        self.steps_started = 0

    def forward_backward(self, inputs, targets):
        if self.steps_started == self.at_step:
            if self.kind == "stall":
                time.sleep(self.seconds)
            elif self.kind == "raise":
                self.steps_started += 1
                raise RuntimeError(f"injected fault at step {self.at_step}")
            else:
                os._exit(1)
        self.steps_started += 1
        return self.runner.forward_backward(inputs, targets)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


@contextlib.contextmanager
def ranks_with_fault(ray, world: int, **fault):
    """`world` fresh RankActors carrying the fault (see `fault_env`), killed afterwards."""
    env = {"env_vars": fault_env(**fault)}
    actors = [RankActor.options(num_cpus=0, runtime_env=env).remote() for _ in range(world)]
    try:
        yield actors
    finally:
        for actor in actors:
            ray.kill(actor)
