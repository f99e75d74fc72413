"""Pipeline actions and the per-rank action lists that make a schedule.

A schedule is data: for every pipeline rank, an ordered list of small frozen `Action`s. The
compute kinds are F (forward), B (full backward), I (input-grad backward), W (weight-grad
backward) and FB (a forward and a full backward of two different stages run overlapped, as in
DualPipeV). Lowering (`plans/pipeline/lowering.py`) adds the communication kinds. The actor interprets
the lowered list of its rank top to bottom, so everything here round-trips through plain
JSON-able dicts.

Conventions (shared with torch.distributed.pipelining):
- `stage` of SEND_F / SEND_B is the sending stage; of RECV_F / RECV_B the receiving stage.
  SEND_F(s) pairs with RECV_F(s + 1); SEND_B(s) pairs with RECV_B(s - 1).
- `peer` is the other rank of a SEND or RECV.
- HANDOFF_F(s) / HANDOFF_B(s) move stage s's output (or input gradient) to stage s + 1
  (or s - 1) when both stages live on the same rank: no communication, but the interpreter
  must still move the tensor.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from rayshard.plans.errors import ScheduleError


class Kind(str, enum.Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 - the letter the zero-bubble papers use
    W = "W"
    FB = "FB"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    HANDOFF_F = "HANDOFF_F"
    HANDOFF_B = "HANDOFF_B"

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.FB})
SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECV_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B})
COMM_KINDS = SEND_KINDS | RECV_KINDS
HANDOFF_KINDS = frozenset({Kind.HANDOFF_F, Kind.HANDOFF_B})
# The RECV that a SEND rendezvous with, and back.
MATCHING_KIND = {
    Kind.SEND_F: Kind.RECV_F,
    Kind.RECV_F: Kind.SEND_F,
    Kind.SEND_B: Kind.RECV_B,
    Kind.RECV_B: Kind.SEND_B,
}


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: a compute on (stage, microbatch), or a transfer to/from `peer`.

    For kind FB, (stage, microbatch) is the forward half and (backward_stage,
    backward_microbatch) the full-backward half; `parts()` splits it.
    """

    kind: Kind
    stage: int
    microbatch: int
    peer: int | None = None
    backward_stage: int | None = None
    backward_microbatch: int | None = None

    def parts(self) -> tuple[Action, ...]:
        """The plain compute actions this action performs (two for FB, itself otherwise)."""
        if self.kind is Kind.FB:
            return (
                Action(Kind.F, self.stage, self.microbatch),
                Action(Kind.B, self.backward_stage, self.backward_microbatch),
            )
        return (self,)

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def to_dict(self) -> dict:
        record: dict = {"kind": self.kind.value, "stage": self.stage, "microbatch": self.microbatch}
        if self.peer is not None:
            record["peer"] = self.peer
        if self.kind is Kind.FB:
            record["backward_stage"] = self.backward_stage
            record["backward_microbatch"] = self.backward_microbatch
        return record

    @staticmethod
    def from_dict(record: dict) -> Action:
        try:
            kind = Kind(record["kind"])
            action = Action(
                kind,
                int(record["stage"]),
                int(record["microbatch"]),
                None if record.get("peer") is None else int(record["peer"]),
                None if record.get("backward_stage") is None else int(record["backward_stage"]),
                None
                if record.get("backward_microbatch") is None
                else int(record["backward_microbatch"]),
            )
        except (KeyError, ValueError, TypeError) as error:
            raise ScheduleError(
                f"cannot read action {record!r}: {error}. Fix: an action needs 'kind' (one of "
                f"{', '.join(k.value for k in Kind)}), integer 'stage' and 'microbatch', and "
                "'peer' for SEND/RECV"
            ) from None
        if (kind in COMM_KINDS) != (action.peer is not None):
            raise ScheduleError(
                f"action {record!r}: SEND/RECV actions need a 'peer' rank and others must not "
                "have one. Fix: add or remove 'peer'"
            )
        if (kind is Kind.FB) != (action.backward_stage is not None):
            raise ScheduleError(
                f"action {record!r}: only FB actions carry 'backward_stage' and "
                "'backward_microbatch'. Fix: add them to the FB action or drop them"
            )
        return action

    def __str__(self) -> str:
        text = f"{self.kind.value}(stage={self.stage}, mb={self.microbatch}"
        if self.kind is Kind.FB:
            text += f" | B stage={self.backward_stage}, mb={self.backward_microbatch}"
        if self.peer is not None:
            text += f", {'to' if self.kind in SEND_KINDS else 'from'} rank {self.peer}"
        return text + ")"


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists plus what is needed to read them.

    `ranks[r]` is rank r's plain list of actions, executed in order. `stage_ranks[s]` is the
    rank that owns stage s. A schedule straight from a generator holds compute actions only;
    `rayshard.plans.pipeline.lowering.lower` returns one that also holds SEND/RECV/HANDOFF actions.
    """

    name: str
    pp: int
    vpp: int
    microbatches: int
    stage_ranks: tuple[int, ...]
    ranks: list[list[Action]] = field(compare=True)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def is_lowered(self) -> bool:
        return any(not action.is_compute for actions in self.ranks for action in actions)

    def rank_of(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def stages_of(self, rank: int) -> list[int]:
        return [stage for stage, owner in enumerate(self.stage_ranks) if owner == rank]

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "pp": self.pp,
            "vpp": self.vpp,
            "microbatches": self.microbatches,
            "stage_ranks": list(self.stage_ranks),
            "ranks": [[action.to_dict() for action in actions] for actions in self.ranks],
        }

    @staticmethod
    def from_dict(record: dict) -> Schedule:
        try:
            return Schedule(
                name=str(record["name"]),
                pp=int(record["pp"]),
                vpp=int(record["vpp"]),
                microbatches=int(record["microbatches"]),
                stage_ranks=tuple(int(rank) for rank in record["stage_ranks"]),
                ranks=[[Action.from_dict(a) for a in actions] for actions in record["ranks"]],
            )
        except (KeyError, TypeError) as error:
            raise ScheduleError(
                f"cannot read schedule: missing or malformed field {error}. Fix: a schedule "
                "needs name, pp, vpp, microbatches, stage_ranks and ranks"
            ) from None

    def with_ranks(self, ranks: list[list[Action]]) -> Schedule:
        return Schedule(self.name, self.pp, self.vpp, self.microbatches, self.stage_ranks, ranks)
