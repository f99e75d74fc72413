"""Simulator: time and activation memory of a lowered schedule.

Given how long every action takes (per-stage costs, or measured per-action durations), the
simulator replays the lowered per-rank lists in an order the checker proved deadlock-free and
gives every action a start and an end, the step time, the bubble fraction, and every rank's
activation memory over time and its peak.

Time model
- A rank runs its list in order, one action at a time; all ranks start at 0.
- Compute: F, I, W and B take their stage's cost (B = I + W); FB (a forward and a full
  backward overlapped) takes F + B - overlap * min(F, B).
- Transfers, comm="async" (default; an interpreter that posts SEND as isend and waits on
  RECV): a SEND costs the sender nothing; the RECV ends at the later of reaching it and the
  send time plus the sending stage's comm cost. comm="rendezvous" (the checker's semantics,
  e.g. blocking send): a SEND and its RECV start together when both ranks have reached them
  and keep both ranks busy for the comm cost. Rendezvous is never faster: where the expected
  timeline offers no moment at which both neighbours are between computes (F=1, B=2 at
  pp >= 8, interleaved), one of them waits.
- HANDOFF between stages on one rank is free.

Definitions
- step time: when the last action on any rank ends.
- bubble fraction: idle / (ranks * step time), where a rank's idle time is step time minus its
  compute time. Waiting and communicating count as idle: both are time the rank is not doing
  F/B/I/W work. With free communication and equal stage costs, GPipe and 1F1B give exactly
  (p - 1) / (m + p - 1).
- activation memory: stage s's forward of a microbatch holds `activation_bytes` of stage s
  from the start of the F until its backward ends (B, or I and W: I frees the fraction
  `input_grad_frees`, W the rest). A rank's memory is the sum over its stages.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from rayshard.plans.pipeline.actions import Action, Kind, Schedule
from rayshard.plans.pipeline.checker import CheckReport, execute
from rayshard.plans.errors import ConfigError, ScheduleError

COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W, Kind.FB)


@dataclass(frozen=True)
class StageCosts:
    """Costs of one stage for one microbatch, in any time unit (seconds, or relative)."""

    forward: float = 1.0
    backward: float = 2.0  # full backward, B = I + W
    weight_grad: float = 1.0  # the W share of the backward
    comm: float = 0.0  # one transfer out of this stage (activation or gradient)
    activation_bytes: float = 1.0  # kept between a microbatch's F and the end of its backward

    @property
    def input_grad(self) -> float:
        return self.backward - self.weight_grad


@dataclass(frozen=True)
class PipelineCosts:
    """Costs of every stage, plus how FB overlap and split backwards behave."""

    stages: tuple[StageCosts, ...]
    overlap: float = 0.0  # share of min(F, B) that FB hides by running F and B together
    input_grad_frees: float = 0.0  # share of a stage's activations I frees (W frees the rest)

    def __post_init__(self):
        for stage, costs in enumerate(self.stages):
            for name in ("forward", "backward", "weight_grad", "comm", "activation_bytes"):
                value = getattr(costs, name)
                if not (math.isfinite(value) and value >= 0):
                    raise ConfigError(f"costs[{stage}].{name}", value, "must be finite and >= 0", "fix the cost")
            if costs.weight_grad > costs.backward:
                raise ConfigError(
                    f"costs[{stage}].weight_grad", costs.weight_grad,
                    f"is more than the whole backward B={costs.backward}",
                    "give W at most B (B = I + W)",
                )
        for name in ("overlap", "input_grad_frees"):
            value = getattr(self, name)
            if not 0 <= value <= 1:
                raise ConfigError(name, value, "is a share and must be within [0, 1]", f"set {name} between 0 and 1")

    @staticmethod
    def uniform(
        num_stages: int,
        forward: float = 1.0,
        backward: float = 2.0,
        weight_grad: float | None = None,
        comm: float = 0.0,
        activation_bytes: float = 1.0,
        overlap: float = 0.0,
        input_grad_frees: float = 0.0,
    ) -> PipelineCosts:
        """The same costs on every stage; W defaults to half the backward."""
        weight_grad = backward / 2 if weight_grad is None else weight_grad
        stage = StageCosts(forward, backward, weight_grad, comm, activation_bytes)
        return PipelineCosts((stage,) * num_stages, overlap, input_grad_frees)

    @staticmethod
    def parse(text: str, num_stages: int, vpp: int = 1, activation_bytes: float = 1.0) -> PipelineCosts:
        """Read "F=1,B=2,W=1[,I=..][,C=0.1][,overlap=0.5][,frees=0.5]" into uniform costs.

        The numbers describe one rank's share of the model (a whole stage when vpp=1); with
        vpp stages per rank each stage computes, and keeps activations of, 1/vpp of it, so
        schedules with different vpp compare on the same model. B is the full backward; give
        any two of B, I, W (B = I + W); W alone defaults to B/2; an empty text means
        F=1,B=2,W=1. C (or comm) is one transfer's time, not divided by vpp; overlap and frees
        as in PipelineCosts.
        """
        values: dict[str, float] = {}
        aliases = {"c": "comm", "comm": "comm", "overlap": "overlap", "frees": "frees"}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            name = key.upper() if key.upper() in ("F", "B", "I", "W") else aliases.get(key.lower())
            try:
                value = float(raw)
            except ValueError:
                value = None
            if not sep or name is None or value is None:
                raise ConfigError(
                    "costs", text, f"cannot read {item!r}",
                    'write KEY=NUMBER pairs separated by commas, keys F, B, I, W, C, overlap, frees: "F=1,B=2,W=1"',
                )
            values[name] = value
        forward = values.get("F", 1.0)
        if "B" in values:
            backward = values["B"]
            weight = values.get("W", backward - values["I"] if "I" in values else backward / 2)
        else:
            input_grad = values.get("I", values.get("W", 1.0))
            weight = values.get("W", input_grad)
            backward = input_grad + weight
        if "B" in values and "I" in values and "W" in values and not math.isclose(
            values["I"] + values["W"], values["B"]
        ):
            raise ConfigError("costs", text, "B is the full backward, so it must equal I + W", "give two of B, I, W")
        share = 1.0 / vpp
        return PipelineCosts.uniform(
            num_stages, forward * share, backward * share, weight * share,
            values.get("comm", 0.0), activation_bytes * share,
            values.get("overlap", 0.0), values.get("frees", 0.0),
        )

    def describe(self) -> str:
        first = self.stages[0]
        same = all(stage == first for stage in self.stages)
        text = (
            f"F={first.forward:g} B={first.backward:g} (I={first.input_grad:g} W={first.weight_grad:g}) "
            f"comm={first.comm:g}"
        )
        if self.overlap:
            text += f" overlap={self.overlap:g}"
        return text if same else text + " on stage 0 (stages differ)"

    def duration(self, action: Action) -> float:
        kind = action.kind
        costs = self.stages[action.stage]
        if kind is Kind.F:
            return costs.forward
        if kind is Kind.B:
            return costs.backward
        if kind is Kind.I:
            return costs.input_grad
        if kind is Kind.W:
            return costs.weight_grad
        if kind is Kind.FB:
            backward = self.stages[action.backward_stage].backward
            return costs.forward + backward - self.overlap * min(costs.forward, backward)
        if kind is Kind.SEND_F or kind is Kind.SEND_B:
            return costs.comm
        return 0.0


@dataclass
class Simulation:
    """Start and end of every action (`starts[rank][step]`), and what follows from them."""

    schedule: Schedule
    comm: str
    starts: list[list[float]]
    ends: list[list[float]]
    busy: list[float]  # compute time per rank
    memory: list[list[tuple[float, float]]]  # per rank: (time, bytes held from then on)
    peak_memory: list[float]
    step_time: float = field(init=False)

    def __post_init__(self):
        self.step_time = max((ends[-1] for ends in self.ends if ends), default=0.0)

    @property
    def bubble_fraction(self) -> float:
        """idle / (ranks * step time); idle = step time - compute time, summed over ranks."""
        if self.step_time == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)

    @property
    def idle(self) -> list[float]:
        return [self.step_time - busy for busy in self.busy]


def simulate(
    schedule: Schedule,
    costs: PipelineCosts | None = None,
    comm: str = "async",
    checked: CheckReport | None = None,
) -> Simulation:
    """Simulate a lowered schedule with per-stage costs (default: F=I=W=1, B=2, free comm).

    checked: a CheckReport of this schedule from `rayshard.plans.pipeline.checker.check`, to reuse its trace.
    """
    costs = costs or PipelineCosts.uniform(schedule.num_stages)
    if len(costs.stages) != schedule.num_stages:
        raise ConfigError(
            "costs", f"{len(costs.stages)} stages", f"the schedule has {schedule.num_stages} stages",
            "give one StageCosts per stage (PipelineCosts.uniform does this for you)",
        )
    activation = [stage.activation_bytes for stage in costs.stages]
    return _replay(schedule, costs.duration, activation, costs.input_grad_frees, comm, checked)


def simulate_measured(
    schedule: Schedule,
    durations: Mapping[tuple[str, int, int], float] | Callable[[Action], float],
    activation_bytes: list[float] | None = None,
    input_grad_frees: float = 0.0,
    comm: str = "async",
    checked: CheckReport | None = None,
) -> Simulation:
    """Simulate with measured time per action, e.g. from a training run's profile.

    durations: {(kind, stage, microbatch): seconds} with kind "F", "B", "I", "W", "FB"
    (keyed by the forward half), "SEND_F" or "SEND_B" (transfer time); or a function of the
    Action. Missing transfers and hand-offs cost 0; a missing compute is an error.
    """
    if callable(durations):
        duration = durations
    else:
        table = durations

        def duration(action: Action) -> float:
            key = (action.kind.value, action.stage, action.microbatch)
            if key in table:
                return float(table[key])
            if action.kind in COMPUTE:
                raise ConfigError(
                    "durations", key, "has no measured time",
                    "measure every compute action, or use costs_from_measurements for averages",
                )
            return 0.0

    activation = activation_bytes or [1.0] * schedule.num_stages
    return _replay(schedule, duration, activation, input_grad_frees, comm, checked)


def costs_from_measurements(
    durations: Mapping[tuple[str, int, int], float], num_stages: int, activation_bytes: float = 1.0
) -> PipelineCosts:
    """Average measured per-action times into per-stage costs (to simulate other schedules).

    B comes from measured B's, else from I + W; a stage with no measurement of a kind keeps
    the mean of that kind over the stages that have one.
    """
    sums: dict[tuple[str, int], list[float]] = {}
    for (kind, stage, _mb), seconds in durations.items():
        sums.setdefault((kind, stage), []).append(float(seconds))

    def mean(kind: str, stage: int) -> float | None:
        values = sums.get((kind, stage))
        if values:
            return sum(values) / len(values)
        overall = [v for (k, _s), vs in sums.items() if k == kind for v in vs]
        return sum(overall) / len(overall) if overall else None

    stages = []
    for stage in range(num_stages):
        forward = mean("F", stage) or 0.0
        weight = mean("W", stage)
        input_grad = mean("I", stage)
        backward = mean("B", stage)
        if backward is None:
            backward = (input_grad or 0.0) + (weight or 0.0)
        weight = weight if weight is not None else backward / 2
        comm = mean("SEND_F", stage) or mean("SEND_B", stage) or 0.0
        stages.append(StageCosts(forward, backward, min(weight, backward), comm, activation_bytes))
    return PipelineCosts(tuple(stages))


def _replay(
    schedule: Schedule,
    duration: Callable[[Action], float],
    activation: list[float],
    input_grad_frees: float,
    comm: str,
    checked: CheckReport | None,
) -> Simulation:
    if comm not in ("rendezvous", "async"):
        raise ConfigError("comm", comm, "is not a communication model", 'use "rendezvous" or "async"')
    if not schedule.is_lowered and schedule.pp > 1:
        raise ScheduleError(
            f"schedule {schedule.name!r} has no communication actions. Fix: simulate "
            "rayshard.plans.pipeline.lowering.lower(schedule)"
        )
    report = checked if checked is not None and checked.schedule is schedule else execute(schedule)
    if report.deadlock is not None:
        raise ScheduleError(f"cannot simulate {schedule.name!r}: " + report.deadlock.describe())
    rendezvous = comm == "rendezvous"
    ranks = schedule.ranks
    starts = [[0.0] * len(actions) for actions in ranks]
    ends = [[0.0] * len(actions) for actions in ranks]
    clock = [0.0] * schedule.pp
    position = [0] * schedule.pp
    busy = [0.0] * schedule.pp
    held = [0.0] * schedule.pp
    peak = [0.0] * schedule.pp
    memory: list[list[tuple[float, float]]] = [[(0.0, 0.0)] for _ in ranks]
    kept_after_input_grad = 1.0 - input_grad_frees
    F, B, I, W, FB = Kind.F, Kind.B, Kind.I, Kind.W, Kind.FB
    SEND_F, SEND_B = Kind.SEND_F, Kind.SEND_B

    for rank in report.trace:
        step = position[rank]
        action = ranks[rank][step]
        kind = action.kind
        start = clock[rank]
        if kind is SEND_F or kind is SEND_B:
            peer = action.peer
            peer_step = position[peer]
            cost = duration(action)
            if rendezvous:
                start = max(start, clock[peer])
                end = start + cost
                starts[peer][peer_step], ends[peer][peer_step], clock[peer] = start, end, end
            else:
                end = start
                arrival = start + cost
                # Time spent waiting for the sender to produce counts as idle, not as transfer.
                peer_start = max(clock[peer], start)
                peer_end = max(clock[peer], arrival)
                starts[peer][peer_step], ends[peer][peer_step], clock[peer] = peer_start, peer_end, peer_end
            position[peer] = peer_step + 1
        elif kind is F or kind is B or kind is I or kind is W or kind is FB:
            end = start + duration(action)
            busy[rank] += end - start
            if kind is F or kind is FB:
                held[rank] += activation[action.stage]
                memory[rank].append((start, held[rank]))
                if held[rank] > peak[rank]:
                    peak[rank] = held[rank]
            if kind is not F:
                if kind is B:
                    freed = activation[action.stage]
                elif kind is I:
                    freed = activation[action.stage] * input_grad_frees
                elif kind is W:
                    freed = activation[action.stage] * kept_after_input_grad
                else:
                    freed = activation[action.backward_stage]
                held[rank] -= freed
                memory[rank].append((end, held[rank]))
        else:  # HANDOFF, or a step the checker skipped
            end = start + duration(action)
        starts[rank][step], ends[rank][step], clock[rank] = start, end, end
        position[rank] = step + 1
    return Simulation(schedule, comm, starts, ends, busy, memory, peak)
