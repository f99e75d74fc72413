"""A pipeline order written by hand, in torch.distributed.pipelining's CSV format.

What torchtitan users write (and torch's `_dump_csv` produces): one row per pipeline rank, one
cell per action in the order the rank runs them, each cell `[stage][kind][microbatch]` (`0F0`,
`3B1`, `1I2`, `1W2`), or a stage's overlapped forward and backward as `(0F1;3B0)OVERLAP_F_B`;
empty cells are idle slots. The "compute_comms" form adds `SEND_F`/`RECV_F`/`SEND_B`/`RECV_B` and
FSDP's `UNSHARD`/`RESHARD`/`REDUCE_GRAD`.

The stage placement is read off the file (the rank whose row runs a stage's forwards owns it) and
must be one rayshard cuts layers for: one stage per rank, looped (interleaved) or V. Transfers are
taken from the file when it has them (so a receive placed where it can never be answered is the
checker's to name) or derived by our own lowering when it has none; FSDP's actions are dropped
(each stage's FSDP2 module gathers and reduces by itself).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from rayshard.plans.errors import ScheduleError
from rayshard.plans.pipeline.actions import COMM_KINDS, Action, Kind, Schedule
from rayshard.plans.pipeline.partition import Placement, stage_ranks

_CELL = re.compile(r"^(\d+)(F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")
_OVERLAP = re.compile(r"^\((.+)\)OVERLAP_F_B$")
_IGNORED = {"UNSHARD", "RESHARD", "REDUCE_GRAD"}  # FSDP2's own business in rayshard
_KINDS = {"F": Kind.F, "I": Kind.I, "B": Kind.B, "W": Kind.W, "SEND_F": Kind.SEND_F, "RECV_F": Kind.RECV_F,
          "SEND_B": Kind.SEND_B, "RECV_B": Kind.RECV_B}
CSV_SCHEDULE = "csv"  # the schedule name a run from a file carries


@dataclass(frozen=True)
class CsvOrder:
    """The file's actions per rank (compute, and transfers without peers yet) and what they imply."""

    ranks: tuple[tuple[Action, ...], ...]
    stage_ranks: tuple[int, ...]
    microbatches: int
    has_transfers: bool
    source: str = "schedule CSV"  # the file's name, for errors found after parsing

    @property
    def pp(self) -> int:
        return len(self.ranks)

    @property
    def vpp(self) -> int:
        return len(self.stage_ranks) // self.pp

    @property
    def placement(self) -> Placement:
        for placement in (Placement.SINGLE, Placement.LOOPED, Placement.V):
            if (placement is Placement.SINGLE) == (self.vpp == 1) and \
                    stage_ranks(self.pp, self.vpp, placement) == self.stage_ranks:
                return placement
        raise ScheduleError(f"the file places stages on ranks as {list(self.stage_ranks)}, which is neither one "
                            "stage per rank, looped (stage s on rank s % pp) nor V; rayshard cuts layers for those. "
                            "Fix: move each stage's actions to the row of its rank under one of them")

    @property
    def splits_backward(self) -> bool:
        return any(action.kind in (Kind.I, Kind.W) for actions in self.ranks for action in actions)


@lru_cache(maxsize=16)
def pipeline_order(rows: tuple[tuple[str, ...], ...]) -> CsvOrder:
    """A run's pipeline order (its config's cells), parsed once: validation, the plan, the stage
    cut and the step runner all ask for it."""
    return parse_pipeline_csv(rows)


def parse_pipeline_csv(rows, where: str = "schedule CSV") -> CsvOrder:
    """`rows`: the file's cells, one sequence per rank (csv.reader's output)."""
    rows = [list(row) for row in rows]
    while rows and not any(cell.strip() for cell in rows[-1]):
        rows.pop()  # a trailing newline
    if not rows:
        raise ScheduleError(f"{where}: no rows. Fix: one row per pipeline rank, e.g. `0F0,0F1,0B0,0B1`")
    ranks: list[list[Action]] = []
    owner: dict[int, int] = {}
    transfers = False
    for rank, row in enumerate(rows):
        actions = []
        for step, cell in enumerate(row):
            text = cell.strip()
            if not text:
                continue
            for action in _actions_of(text, f"{where}: rank {rank} step {step} ({text!r})"):
                if action.kind in COMM_KINDS:
                    transfers = True
                elif action.kind is Kind.F:
                    if owner.setdefault(action.stage, rank) != rank:
                        raise ScheduleError(f"{where}: rank {rank} step {step} runs {text!r}, but stage {action.stage}'s "
                                            f"forwards run on rank {owner[action.stage]}. Fix: a stage lives on one rank")
                actions.append(action)
        ranks.append(actions)
    stages = max(owner, default=-1) + 1
    missing = [stage for stage in range(stages) if stage not in owner]
    if not owner or missing:
        raise ScheduleError(f"{where}: stage(s) {missing or [0]} never run a forward. Fix: list each stage's F actions")
    if stages % len(ranks):
        raise ScheduleError(f"{where}: {stages} stages over {len(ranks)} ranks is not a whole number per rank. "
                            "Fix: give every rank the same number of stages")
    for rank, actions in enumerate(ranks):
        for step, action in enumerate(actions):
            if action.kind not in COMM_KINDS and any(owner.get(p.stage) != rank for p in action.parts()):
                raise ScheduleError(f"{where}: rank {rank} runs {action}, but stage {action.stage} lives on rank "
                                    f"{owner.get(action.stage)}. Fix: move the action to that rank's row")
    microbatches = 1 + max(part.microbatch for actions in ranks for action in actions for part in action.parts())
    _check_each_microbatch_once(ranks, stages, microbatches, where)
    return CsvOrder(tuple(tuple(a) for a in ranks), tuple(owner[s] for s in range(stages)), microbatches, transfers,
                    where)


def _check_each_microbatch_once(ranks: list[list[Action]], stages: int, microbatches: int, where: str) -> None:
    """Every (stage, microbatch) runs one F and one backward (a B, or an I and a W)."""
    counts: dict[tuple[Kind, int, int], int] = {}
    for actions in ranks:
        for action in actions:
            for part in action.parts():
                if part.kind not in COMM_KINDS:
                    key = (part.kind, part.stage, part.microbatch)
                    counts[key] = counts.get(key, 0) + 1
    for stage in range(stages):
        for mb in range(microbatches):
            f, b, i, w = (counts.get((kind, stage, mb), 0) for kind in (Kind.F, Kind.B, Kind.I, Kind.W))
            if f != 1:
                raise ScheduleError(f"{where}: stage {stage} microbatch {mb} runs {f} forwards ({stage}F{mb}). "
                                    "Fix: list it exactly once")
            if not ((b == 1 and i == w == 0) or (b == 0 and i == w == 1)):
                raise ScheduleError(f"{where}: stage {stage} microbatch {mb} has {b} B, {i} I and {w} W; it needs one B "
                                    f"or one I and one W. Fix: add or remove {stage}B{mb} (or {stage}I{mb}/{stage}W{mb})")


def _actions_of(text: str, where: str) -> list[Action]:
    overlap = _OVERLAP.match(text)
    if overlap:
        parts = [_one(part.strip(), where) for part in overlap.group(1).split(";")]
        kinds = [part.kind if part else None for part in parts]
        if kinds != [Kind.F, Kind.B]:
            raise ScheduleError(f"{where}: an overlapped cell holds one F then one B. Fix: write (sF m;sB m)OVERLAP_F_B")
        forward, backward = parts
        return [Action(Kind.FB, forward.stage, forward.microbatch, backward_stage=backward.stage,
                       backward_microbatch=backward.microbatch)]
    action = _one(text, where)
    return [action] if action is not None else []


def _one(text: str, where: str) -> Action | None:
    match = _CELL.match(text)
    if not match:
        raise ScheduleError(f"{where}: not an action. Fix: write [stage][F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B][microbatch], "
                            "e.g. 2F0")
    stage, kind, microbatch = match.groups()
    if kind in _IGNORED:
        return None
    if not microbatch:
        raise ScheduleError(f"{where}: {kind} needs a microbatch number. Fix: e.g. {stage}{kind}0")
    return Action(_KINDS[kind], int(stage), int(microbatch), peer=-1 if kind in ("SEND_F", "RECV_F", "SEND_B", "RECV_B") else None)


def schedule_of(order: CsvOrder) -> Schedule:
    """The compute-only schedule (lower it with `rayshard.plans.pipeline.lowering.lower`)."""
    ranks = [[action for action in actions if action.kind not in COMM_KINDS] for actions in order.ranks]
    return Schedule(CSV_SCHEDULE, order.pp, order.vpp, order.microbatches, order.stage_ranks, ranks)


def lowered_as_written(order: CsvOrder) -> Schedule:
    """The file's own transfers, with their peers, and a hand-off after each compute whose
    neighbouring stage is on the same rank (where torch moves the tensor without a transfer)."""
    owner, last = order.stage_ranks, len(order.stage_ranks) - 1
    ranks = []
    for rank, actions in enumerate(order.ranks):
        lowered = []
        for action in actions:
            if action.kind in COMM_KINDS:
                peer_stage = {Kind.SEND_F: action.stage + 1, Kind.RECV_F: action.stage - 1,
                              Kind.SEND_B: action.stage - 1, Kind.RECV_B: action.stage + 1}[action.kind]
                if not 0 <= peer_stage <= last or owner[peer_stage] == rank:
                    raise ScheduleError(f"{order.source}: rank {rank} has {action.kind.value} for stage {action.stage}, "
                                        f"but {'no stage' if not 0 <= peer_stage <= last else 'the same rank'} is on the "
                                        "other end. Fix: drop it")
                lowered.append(Action(action.kind, action.stage, action.microbatch, owner[peer_stage]))
                continue
            lowered.append(action)
            for part in action.parts():
                if part.kind is Kind.F and part.stage < last and owner[part.stage + 1] == rank:
                    lowered.append(Action(Kind.HANDOFF_F, part.stage, part.microbatch))
                elif part.kind in (Kind.B, Kind.I) and part.stage > 0 and owner[part.stage - 1] == rank:
                    lowered.append(Action(Kind.HANDOFF_B, part.stage, part.microbatch))
        ranks.append(lowered)
    return Schedule(CSV_SCHEDULE, order.pp, order.vpp, order.microbatches, order.stage_ranks, ranks)
