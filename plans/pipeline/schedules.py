"""Pipeline schedules as generators of per-rank compute action lists.

Each generator returns, for every rank, the order in which that rank runs F / B / I / W / FB
actions; `plans/pipeline/lowering.py` adds the communication and `plans/pipeline/checker.py` proves the result.
Stage numbering is global (0 .. pp * vpp - 1, in model order); `SPECS` says how each schedule
places stages on ranks, which vpp and microbatch counts it serves, and how many microbatch
activations a rank holds at most (`memory_bound`), which the simulator is tested against.

Memory is counted in "stage activations": what one microbatch leaves behind in one stage
between its forward and the end of its backward (B, or W when the backward is split; the
conservative reading, since I frees part of it). Bounds assume equal activations per stage.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rayshard.plans.pipeline.actions import Action, Kind, Schedule
from rayshard.plans.errors import ConfigError, ScheduleError
from rayshard.plans.pipeline.partition import Placement, stage_ranks

F, B, I, W = Kind.F, Kind.B, Kind.I, Kind.W  # noqa: E741


# --- GPipe and 1F1B: one stage per rank ----------------------------------------------------


def gpipe(pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
    """All forwards, then all backwards: simplest, holds every microbatch's activations."""
    return [
        [Action(F, rank, mb) for mb in range(microbatches)]
        + [Action(B, rank, mb) for mb in range(microbatches)]
        for rank in range(pp)
    ]


def one_f_one_b(pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
    """PipeDream-flush 1F1B: pp-1-r warm-up forwards, then alternate F and B, then drain."""
    ranks = []
    for rank in range(pp):
        warmup = min(pp - 1 - rank, microbatches)
        actions = [Action(F, rank, mb) for mb in range(warmup)]
        for step in range(microbatches - warmup):
            actions += [Action(F, rank, warmup + step), Action(B, rank, step)]
        actions += [Action(B, rank, mb) for mb in range(microbatches - warmup, microbatches)]
        ranks.append(actions)
    return ranks


# --- Interleaved 1F1B and ZB-H1: the looped family ----------------------------------------


def _microbatches_per_round(pp: int, microbatches: int) -> int:
    # Rounds of depth-first order (Megatron uses rounds of exactly pp microbatches); like
    # torch's flexible variant, m need only split into max(1, m // pp) equal rounds.
    rounds = max(1, microbatches // pp)
    return microbatches // rounds


def _interleaved_warmup(pp: int, vpp: int, microbatches: int, rank: int, hop_factor: int) -> int:
    per_round = _microbatches_per_round(pp, microbatches)
    # The last rank must run every chunk but its last one for a full round before its first
    # backward can start; each hop towards rank 0 adds `hop_factor` more forwards.
    warmup = (vpp - 1) * per_round + hop_factor * (pp - 1 - rank)
    return min(warmup, microbatches * vpp)


def _looped_rank(
    pp: int, vpp: int, microbatches: int, rank: int, warmup: int, weight_lag: int | None
) -> list[Action]:
    """One rank's order in the looped family: warm-up forwards, 1F1B steady state, drain.

    Forward op k runs chunk (k // R) % vpp; backward op k runs the chunks in reverse, where R
    is the microbatches per round. With `weight_lag` set, backwards are split: I, and the W of
    the I issued `weight_lag` backward ops earlier (so the W fills later bubbles).
    """
    per_round = _microbatches_per_round(pp, microbatches)
    total = microbatches * vpp
    next_forward_mb = [0] * vpp
    next_backward_mb = [0] * vpp
    issued_input_grads: list[tuple[int, int]] = []
    weights_done = 0
    actions: list[Action] = []

    def forward(op: int) -> None:
        chunk = (op // per_round) % vpp
        actions.append(Action(F, chunk * pp + rank, next_forward_mb[chunk]))
        next_forward_mb[chunk] += 1

    def backward(op: int) -> None:
        nonlocal weights_done
        chunk = vpp - 1 - (op // per_round) % vpp
        stage, mb = chunk * pp + rank, next_backward_mb[chunk]
        next_backward_mb[chunk] += 1
        if weight_lag is None:
            actions.append(Action(B, stage, mb))
            return
        actions.append(Action(I, stage, mb))
        issued_input_grads.append((stage, mb))
        if op >= weight_lag:
            actions.append(Action(W, *issued_input_grads[weights_done]))
            weights_done += 1

    for op in range(warmup):
        forward(op)
    for op in range(total - warmup):
        forward(warmup + op)
        backward(op)
    for op in range(total - warmup, total):
        backward(op)
    for stage, mb in issued_input_grads[weights_done:]:
        actions.append(Action(W, stage, mb))
    return actions


def interleaved_1f1b(pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B: vpp looped stages per rank, depth-first by rounds."""
    if vpp == 1:
        return one_f_one_b(pp, vpp, microbatches)
    return [
        _looped_rank(
            pp, vpp, microbatches, rank,
            _interleaved_warmup(pp, vpp, microbatches, rank, hop_factor=2), weight_lag=None,
        )
        for rank in range(pp)
    ]


def zb_h1(pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2024): 1F1B with B split into I and W; rank r defers its W by r ops.

    Rank pp-1 finishes its input grads first and would idle through the drain; its deferred
    W's fill that time, while every rank keeps at most pp microbatches alive (1F1B's rank 0).
    """
    return [
        _looped_rank(
            pp, 1, microbatches, rank,
            _interleaved_warmup(pp, 1, microbatches, rank, hop_factor=1), weight_lag=rank,
        )
        for rank in range(pp)
    ]


# --- V-shaped schedules: rank r owns stages r and 2pp-1-r -----------------------------------


def zb_v(pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2024, section 6), following torch.distributed.pipelining's generator.

    Zero bubble when F, I and W cost the same and microbatches >= 2 * pp, at 1F1B's memory.
    Fewer microbatches are served by generating for 2 * pp - 1 and dropping the extra ones.
    """
    generated = max(2 * pp - 1, microbatches)
    ranks = []
    for rank in range(pp):
        down, up = rank, 2 * pp - 1 - rank  # the rank's stage on the way down and back up
        counts = {(F, down): 0, (F, up): 0, (I, down): 0, (I, up): 0, (W, down): 0, (W, up): 0}
        actions: list[Action] = []

        def emit(kind: Kind, stage: int) -> None:
            actions.append(Action(kind, stage, counts[kind, stage]))
            counts[kind, stage] += 1

        for _ in range(2 * (pp - rank) - 1):
            emit(F, down)
        for _ in range(rank):
            emit(F, up)
            emit(F, down)
        for _ in range(pp - rank):
            emit(F, up)
            emit(I, up)
            emit(W, up)
        while counts[F, up] < counts[F, down] or counts[F, down] < generated:
            if counts[F, down] < generated:
                emit(F, down)
            emit(I, down)
            emit(W, down)
            emit(F, up)
            emit(I, up)
            emit(W, up)
        for _ in range(rank):
            emit(I, down)
            emit(I, up)
        for _ in range(pp - rank):
            emit(I, down)
            emit(W, down)
        while counts[W, up] < counts[I, up]:
            emit(W, up)
        while counts[W, down] < counts[I, down]:
            emit(W, down)
        ranks.append([action for action in actions if action.microbatch < microbatches])
    return ranks


def dualpipe_v(pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half), following DeepSeek's reference order.

    The steady state runs FB pairs: the forward of one stage overlapped with the full backward
    of the rank's other stage, so one microbatch's communication hides behind the other's
    compute. The drain splits backwards into I and W to fill the tail.
    """
    ranks = []
    for rank in range(pp):
        down, up = rank, 2 * pp - 1 - rank
        next_mb = {(F, down): 0, (F, up): 0, (B, down): 0, (B, up): 0}
        pending_weights: list[tuple[int, int]] = []
        actions: list[Action] = []

        def take(kind: Kind, stage: int) -> int:
            mb = next_mb[kind, stage]
            next_mb[kind, stage] += 1
            return mb

        def forward(stage: int) -> None:
            actions.append(Action(F, stage, take(F, stage)))

        def backward(stage: int, split: bool) -> None:
            mb = take(B, stage)
            if split:
                actions.append(Action(I, stage, mb))
                pending_weights.append((stage, mb))
            else:
                actions.append(Action(B, stage, mb))

        def overlapped(forward_stage: int, backward_stage: int) -> None:
            forward_mb = take(F, forward_stage)
            backward_mb = take(B, backward_stage)
            actions.append(Action(Kind.FB, forward_stage, forward_mb, None, backward_stage, backward_mb))

        def weight_if_pending() -> None:
            if pending_weights:
                actions.append(Action(W, *pending_weights.pop(0)))

        for _ in range(2 * (pp - rank - 1)):
            forward(down)
        for _ in range(rank + 1):
            forward(down)
            forward(up)
        for _ in range(pp - rank - 1):
            backward(up, split=True)
            weight_if_pending()
            forward(up)
        for step in range(microbatches - 2 * pp + rank + 1):
            if step == 0 and rank == pp - 1:
                # The turn of the V: overlapping here would only delay the first backward.
                forward(down)
                backward(up, split=False)
            else:
                overlapped(down, up)
            overlapped(up, down)
        for _ in range(pp - rank - 1):
            backward(up, split=False)
            overlapped(up, down)
        split = False
        drain = rank + 1
        for step in range(drain):
            if step == drain // 2 and rank % 2 == 1:
                split = True
            backward(up, split)
            if step == drain // 2 and rank % 2 == 0:
                split = True
            backward(down, split)
        for _ in range(pp - rank - 1):
            weight_if_pending()
            backward(down, split)
        while pending_weights:
            weight_if_pending()
        ranks.append(actions)
    return ranks


# --- The registry ---------------------------------------------------------------------------


def _any_count(pp: int, vpp: int, microbatches: int) -> bool:
    return microbatches >= 1


def _whole_rounds(pp: int, vpp: int, microbatches: int) -> bool:
    return microbatches >= 1 and microbatches % max(1, microbatches // pp) == 0


def _at_least_two_per_rank(pp: int, vpp: int, microbatches: int) -> bool:
    return microbatches >= 2 * pp


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule needs and promises, beside its generator."""

    name: str
    title: str
    placement: Placement
    default_vpp: int
    generate: Callable[[int, int, int], list[list[Action]]]
    accepts: Callable[[int, int, int], bool]
    counts_rule: str  # which counts `accepts` takes, for errors; "{two_pp}" becomes 2 * pp
    # Most stage activations `rank` holds at once (see the module docstring).
    memory_bound: Callable[[int, int, int, int], int]
    aliases: tuple[str, ...] = ()
    # The backward runs as I (input gradient) and W (weight gradients) actions: zero-bubble schedules.
    splits_backward: bool = False

    @property
    def fixed_vpp(self) -> bool:
        return self.placement is not Placement.LOOPED


def _interleaved_bound(pp: int, vpp: int, m: int, rank: int) -> int:
    if vpp == 1:
        return min(pp - rank, m)
    return min(_interleaved_warmup(pp, vpp, m, rank, hop_factor=2) + 1, m * vpp)


SPECS: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in [
        ScheduleSpec(
            "gpipe", "GPipe", Placement.SINGLE, 1, gpipe, _any_count, "any count >= 1",
            lambda pp, vpp, m, rank: m,
        ),
        ScheduleSpec(
            "1f1b", "1F1B", Placement.SINGLE, 1, one_f_one_b, _any_count, "any count >= 1",
            lambda pp, vpp, m, rank: min(pp - rank, m),
        ),
        ScheduleSpec(
            "interleaved1f1b", "Interleaved 1F1B", Placement.LOOPED, 2, interleaved_1f1b,
            _whole_rounds, "a count that splits into max(1, m // pp) equal rounds",
            _interleaved_bound, aliases=("i1f1b",),
        ),
        ScheduleSpec(
            "zbh1", "ZB-H1", Placement.SINGLE, 1, zb_h1, _any_count, "any count >= 1",
            lambda pp, vpp, m, rank: min(pp, m), splits_backward=True,
        ),
        ScheduleSpec(
            "zbv", "ZB-V", Placement.V, 2, zb_v, _any_count, "any count >= 1",
            lambda pp, vpp, m, rank: min(2 * pp, 2 * m), splits_backward=True,
        ),
        ScheduleSpec(
            "dualpipev", "DualPipeV", Placement.V, 2, dualpipe_v, _at_least_two_per_rank,
            "at least 2 * pp = {two_pp} microbatches",
            lambda pp, vpp, m, rank: min(2 * pp + 1, 2 * m), splits_backward=True,
        ),
    ]
}
_ALIASES = {alias: spec.name for spec in SPECS.values() for alias in spec.aliases}


def schedule_spec(name: str) -> ScheduleSpec:
    key = name.strip().lower().replace("-", "").replace("_", "")
    key = _ALIASES.get(key, key)
    if key not in SPECS:
        names = ", ".join(list(SPECS) + list(_ALIASES))
        raise ScheduleError(f"unknown schedule {name!r}. Fix: use one of {names}")
    return SPECS[key]


def schedule_for_vpp(schedule: str, vpp: int) -> str:
    """The schedule that places `vpp` stages per rank, for a layout named without a schedule that
    fits (a reshard target given by its degrees, a checkpoint's schedule paired with a new vpp):
    `schedule` itself, unless it holds one stage per rank while vpp > 1, where interleaved 1F1B's
    looped placement is the one that fits. Training does not fall back: its config validation
    rejects such a pair with a fix."""
    if vpp > 1 and schedule_spec(schedule).placement is Placement.SINGLE:
        return "interleaved1f1b"
    return schedule


def valid_microbatch_counts(name: str, pp: int, vpp: int | None = None, up_to: int | None = None) -> list[int]:
    """The microbatch counts in 1..up_to (default 4 * pp) that schedule `name` serves."""
    spec = schedule_spec(name)
    vpp = spec.default_vpp if vpp is None else vpp
    return [m for m in range(1, (up_to or 4 * pp) + 1) if spec.accepts(pp, vpp, m)]


def build_schedule(name: str, pp: int, microbatches: int, vpp: int | None = None) -> Schedule:
    """The compute-only schedule `name` for pp ranks, `microbatches` microbatches, vpp chunks.

    vpp defaults to the schedule's own (2 for interleaved 1F1B, ZB-V and DualPipeV, else 1).
    Raises ScheduleError for counts the schedule cannot serve, naming the ones it can.
    """
    spec = schedule_spec(name)
    vpp = spec.default_vpp if vpp is None else vpp
    if pp < 1:
        raise ConfigError("pp", pp, "must be at least 1", "use pp >= 1")
    if spec.fixed_vpp and vpp != spec.default_vpp:
        raise ConfigError(
            "vpp", vpp, f"{spec.title} runs exactly {spec.default_vpp} stage(s) per rank",
            f"use vpp={spec.default_vpp}, or interleaved1f1b for other vpp",
        )
    if vpp < 1:
        raise ConfigError("vpp", vpp, "must be at least 1", "use vpp >= 1")
    if not spec.accepts(pp, vpp, microbatches):
        counts = valid_microbatch_counts(spec.name, pp, vpp, max(4 * pp, microbatches))
        nearby = [m for m in counts if abs(m - microbatches) <= 2 * pp][:12] or counts[:12]
        raise ScheduleError(
            f"{spec.title} cannot run {microbatches} microbatches on pp={pp}"
            + (f" with vpp={vpp}" if vpp > 1 else "")
            + f": it needs {spec.counts_rule.format(two_pp=2 * pp)}. Fix: use one of "
            + ", ".join(map(str, nearby))
        )
    ranks = spec.generate(pp, vpp, microbatches)
    return Schedule(spec.name, pp, vpp, microbatches, stage_ranks(pp, vpp, spec.placement), ranks)


def memory_bounds(schedule: Schedule) -> list[int]:
    """The stage activations each rank of `schedule` holds at most, per its schedule's promise."""
    spec = schedule_spec(schedule.name)
    return [
        spec.memory_bound(schedule.pp, schedule.vpp, schedule.microbatches, rank)
        for rank in range(schedule.pp)
    ]
