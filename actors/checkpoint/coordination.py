"""The few messages the ranks of a `rayshard.checkpoint` save or load exchange, over a process
group of their own, each wait bounded.

A save is four exchanges of small records (what each rank holds; who writes what under which
attempt; the chunks each wrote; the committed URL), a load two (the checkpoint and its manifest;
the parts each read, or only whether every rank read cleanly and whole). Every rank takes part in every exchange whatever happened to it, sending
either its answer or its failure, so a rank that fails makes the others fail at the next
exchange, naming it, instead of leaving them waiting. A rank that dies or hangs is bounded by the
group's timeout (`RAYSHARD_CHECKPOINT_TIMEOUT_S`, default 1800 s, torch's own default): the
others' exchange then fails, in one line.

The group is a gloo group over the caller's ranks, made once per process group (a collective
among those ranks only), so the exchanges go over CPU whatever the training backend (NCCL
included) and never interleave with the caller's own collectives: an async save runs them on a
background thread while training goes on. Records travel as pickles between live processes
(torch's object collectives), never into a checkpoint.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from rayshard.actors.parallel.group_sockets import recording_group_sockets
from rayshard.plans.errors import CheckpointError

TIMEOUT_ENV = "RAYSHARD_CHECKPOINT_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 1800.0

# (the default group, the caller's group, timeout) -> our gloo group over the same ranks, for the
# current default group only: a world destroyed and started again (a test's second world, an
# elastic restart in the same process) drops the earlier world's groups, whose sockets close only
# once nothing refers to them.
_GROUPS: dict[tuple, object] = {}


@dataclass(frozen=True)
class Failure:
    """A rank's failure as the others learn it: its rank in the group and one line."""

    rank: int
    line: str

    @classmethod
    def of(cls, rank: int, error: BaseException) -> "Failure":
        text = str(error).strip().splitlines()
        return cls(rank, f"{type(error).__name__}: {text[0] if text else 'no detail'}"
                         + (" (...)" if len(text) > 1 else ""))


class RanksFailed(CheckpointError):
    """Another rank's failure, raised on the ranks that did not fail themselves."""


def timeout_s() -> float:
    text = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(text) if text.strip() else DEFAULT_TIMEOUT_S
    except ValueError:
        raise CheckpointError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds. Fix: set it to e.g. 600") from None
    if value <= 0:
        raise CheckpointError(f"{TIMEOUT_ENV}={text!r} must be positive. Fix: set it to e.g. 600")
    return value


class Coordination:
    """The exchanges of one save or load. `what` names it in every error ("save of run@20")."""

    def __init__(self, process_group=None, what: str = "checkpoint"):
        self.what = what
        self.distributed = dist.is_available() and dist.is_initialized()
        self.timeout_s = timeout_s()
        if not self.distributed:
            self.group, self.rank, self.size = None, 0, 1
            return
        self.rank = dist.get_rank()  # until the group exists, for an error while making it
        self.group = self._run("making the checkpoint's own process group (every rank must call this save or load)",
                               lambda: group_for(process_group, self.timeout_s))
        self.rank, self.size = dist.get_rank(self.group), dist.get_world_size(self.group)

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def gather(self, phase: str, record) -> list | None:
        """Every rank's record on the root (None elsewhere)."""
        if not self.distributed:
            return [record]
        gathered = [None] * self.size if self.is_root else None
        self._run(phase, lambda: dist.gather_object(record, gathered, group=self.group, group_dst=0))
        return gathered

    def broadcast(self, phase: str, record=None):
        """The root's record on every rank."""
        if not self.distributed:
            return record
        box = [record]
        self._run(phase, lambda: dist.broadcast_object_list(box, group=self.group, group_src=0))
        return box[0]

    def all_true(self, phase: str, mine: bool) -> bool:
        """Whether every rank's `mine` is true, on every rank: one small all-reduce, where a
        gather and a broadcast of records are four collectives and two pickles (a load whose ranks
        all read cleanly skips its records exchange, decision 229)."""
        if not self.distributed:
            return mine
        flag = torch.tensor([1 if mine else 0], dtype=torch.int32)
        self._run(phase, lambda: dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group))
        return bool(flag.item())

    def scatter(self, phase: str, records: list | None = None):
        """records[r] (given on the root) on rank r."""
        if not self.distributed:
            return records[0]
        box = [None]
        self._run(phase, lambda: dist.scatter_object_list(box, records if self.is_root else None,
                                                          group=self.group, group_src=0))
        return box[0]

    def _run(self, phase: str, exchange):
        """exchange()'s result; a failure of it as one line naming this rank and the phase."""
        try:
            return exchange()
        except Exception as error:  # gloo: a peer's connection closed, or the timeout passed
            first = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
            raise CheckpointError(
                f"{self.what}: rank {self.rank} lost the other ranks while {phase} ({type(error).__name__}: {first}); "
                f"a rank died or did not answer within {self.timeout_s:g} s ({TIMEOUT_ENV}). Nothing was committed by "
                "this exchange. Fix: see the failed rank's own error; rerun once every rank is healthy") from None

    def raise_failures(self, failures: list[Failure], own: BaseException | None = None) -> None:
        """Raise after an exchange that carried failures: this rank's own error where it failed,
        else a RanksFailed naming the first rank that did (and how many did)."""
        if own is not None:
            raise own
        if failures:
            raise RanksFailed(ranks_failed_line(self.what, failures))


def ranks_failed_line(what: str, failures: list[Failure]) -> str:
    first = failures[0]
    more = f" (and {len(failures) - 1} more rank(s))" if len(failures) > 1 else ""
    return f"{what} failed on rank {first.rank}{more}: {first.line}"


def group_for(process_group, timeout: float):
    """Our gloo group over the ranks of `process_group` (the world when None)."""
    key = (dist.group.WORLD, process_group, timeout)
    for stale in [held for held in _GROUPS if held[0] is not dist.group.WORLD]:
        del _GROUPS[stale]
    if key not in _GROUPS:
        ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        with recording_group_sockets():
            _GROUPS[key] = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout),
                                          use_local_synchronization=True)
    return _GROUPS[key]
