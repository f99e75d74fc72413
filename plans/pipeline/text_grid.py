"""A compact text grid of a simulated schedule, for terminals.

One row per rank, one column per time slot (the shortest compute action). A compute shows as
its kind and microbatch ("F3"), run on for as many slots as it lasts ("B3---"); "." is idle and
"~" a transfer in progress (only when transfers cost time). Times are rounded to slots, so
costs that are not multiples of the shortest compute draw approximately. Stages after a rank's first are in lowercase ("f3" is the forward
of microbatch 3 on the rank's second or later stage); an overlapped pair reads "F5b2".
"""
from __future__ import annotations

from rayshard.plans.pipeline.actions import Action, Kind, Schedule
from rayshard.plans.pipeline.simulator import Simulation

MAX_SLOTS = 400  # wider grids stop being readable in a terminal; draw the PNG instead
LEGEND = (
    "F forward, B backward, I input-grad, W weight-grad, FB overlapped pair; number = "
    "microbatch; lowercase = the rank's later stage; '.' idle, '~' transfer"
)


def stage_chunks(schedule: Schedule) -> list[int]:
    """For every stage, its position among its rank's stages (0 for the rank's first)."""
    chunks = [0] * schedule.num_stages
    for rank in range(schedule.pp):
        for chunk, stage in enumerate(schedule.stages_of(rank)):
            chunks[stage] = chunk
    return chunks


def action_label(action: Action, chunks: list[int]) -> str:
    """"F3" for chunk 0, "f3" for later chunks; "F5b2" for an FB pair."""

    def one(kind: Kind, stage: int, mb: int) -> str:
        letter = kind.value
        return (letter if chunks[stage] == 0 else letter.lower()) + str(mb)

    if action.kind is Kind.FB:
        return one(Kind.F, action.stage, action.microbatch) + one(
            Kind.B, action.backward_stage, action.backward_microbatch
        )
    return one(action.kind, action.stage, action.microbatch)


def text_grid(simulation: Simulation, max_slots: int = MAX_SLOTS) -> str:
    """The grid as one string, or a one-line note when it would exceed `max_slots` columns."""
    schedule = simulation.schedule
    durations = [
        end - start
        for actions, starts, ends in zip(schedule.ranks, simulation.starts, simulation.ends)
        for action, start, end in zip(actions, starts, ends)
        if action.is_compute and end > start
    ]
    if not durations:
        return "(nothing to draw: no compute takes time)"
    slot = min(durations)
    slots = round(simulation.step_time / slot)
    if slots > max_slots:
        return f"(grid omitted: {slots} time slots is too wide for a terminal; draw a PNG instead)"
    chunks = stage_chunks(schedule)
    labels = [
        action_label(action, chunks)
        for actions in schedule.ranks
        for action in actions
        if action.is_compute
    ]
    width = max(len(label) for label in labels) + 1
    rows = []
    for rank, actions in enumerate(schedule.ranks):
        cells = ["." + " " * (width - 1)] * slots
        for action, start, end in zip(actions, simulation.starts[rank], simulation.ends[rank]):
            first, last = round(start / slot), round(end / slot)
            if last <= first:
                continue
            if action.is_compute:
                text = action_label(action, chunks).ljust(width * (last - first) - 1, "-") + " "
            else:
                text = "~" * (width * (last - first) - 1) + " "
            for offset in range(last - first):
                cells[first + offset] = text[offset * width : (offset + 1) * width]
        rows.append(f"rank {rank:<3}|" + "".join(cells).rstrip())
    return "\n".join(rows)
