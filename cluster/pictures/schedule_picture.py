"""Gantt chart PNG of a simulated pipeline schedule (matplotlib, headless Agg backend).

One row per rank; F / B / I / W / FB blocks coloured by kind, with the microbatch number in the
cell; the rank's later stages in a lighter shade; transfers in grey; idle time (the bubble) as
the hatched background that shows through. plans/ stays free of I/O, so drawing lives here.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on cluster nodes or in CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from rayshard.plans.pipeline.actions import Kind  # noqa: E402
from rayshard.plans.pipeline.text_grid import stage_chunks  # noqa: E402
from rayshard.plans.pipeline.csv_order import CSV_SCHEDULE  # noqa: E402
from rayshard.plans.pipeline.schedules import schedule_spec  # noqa: E402
from rayshard.plans.pipeline.simulator import Simulation  # noqa: E402

COLOURS = {
    Kind.F: "#4e79a7",
    Kind.B: "#e15759",
    Kind.I: "#f28e2b",
    Kind.W: "#59a14f",
}
TRANSFER_COLOUR = "#8c8c8c"
IDLE_COLOUR = "#f3f3f3"
ROW_HEIGHT = 0.8


def _lighter(colour: str, share: float) -> tuple[float, float, float]:
    """`colour` mixed with white; later stages of a rank get the lighter shade."""
    red, green, blue = (int(colour[i : i + 2], 16) / 255 for i in (1, 3, 5))
    return tuple(channel + (1 - channel) * share for channel in (red, green, blue))


def _shade(kind: Kind, chunk: int) -> tuple[float, float, float]:
    return _lighter(COLOURS[kind], min(0.45 * chunk, 0.7))


def draw_schedule(simulation: Simulation, path: str | Path, title: str | None = None) -> Path:
    """Draw `simulation` as a Gantt chart into the PNG file `path` and return the path."""
    schedule = simulation.schedule
    chunks = stage_chunks(schedule)
    step_time = simulation.step_time or 1.0
    shortest = min(
        (end - start for actions, starts, ends in zip(schedule.ranks, simulation.starts, simulation.ends)
         for action, start, end in zip(actions, starts, ends) if action.is_compute and end > start),
        default=step_time,
    )
    # About a third of an inch per shortest cell keeps one- and two-digit numbers legible.
    width = min(max(8.0, 0.32 * step_time / shortest + 2.0), 30.0)
    height = 1.5 + 0.55 * schedule.pp
    figure, axes = plt.subplots(figsize=(width, height), dpi=110)
    # Points across one unit of time: decides whether a cell is wide enough for its number.
    points_per_time = (width - 1.6) * 72 / step_time

    for rank in range(schedule.pp):
        row = schedule.pp - 1 - rank  # rank 0 on top
        axes.add_patch(
            Rectangle((0, row - ROW_HEIGHT / 2), step_time, ROW_HEIGHT, facecolor=IDLE_COLOUR,
                      edgecolor="#d0d0d0", hatch="////", linewidth=0)
        )
        for action, start, end in zip(schedule.ranks[rank], simulation.starts[rank], simulation.ends[rank]):
            if end <= start:
                continue
            if not action.is_compute:
                axes.add_patch(Rectangle((start, row - ROW_HEIGHT / 2), end - start, ROW_HEIGHT * 0.25,
                                         facecolor=TRANSFER_COLOUR, linewidth=0))
                continue
            parts = action.parts()
            part_height = ROW_HEIGHT / len(parts)
            for index, part in enumerate(parts):
                bottom = row + ROW_HEIGHT / 2 - (index + 1) * part_height
                axes.add_patch(Rectangle((start, bottom), end - start, part_height,
                                         facecolor=_shade(part.kind, chunks[part.stage]),
                                         edgecolor="white", linewidth=0.8))
                cell_points = (end - start) * points_per_time
                font = min(9.0, cell_points / (0.62 * len(str(part.microbatch)) + 0.4), 8.5 * len(parts) ** -0.3)
                if font >= 4.5:
                    axes.text((start + end) / 2, bottom + part_height / 2, str(part.microbatch),
                              ha="center", va="center", fontsize=font, color="white",
                              fontweight="bold")

    axes.set_xlim(0, step_time)
    axes.set_ylim(-0.6, schedule.pp - 0.4)
    axes.set_yticks(range(schedule.pp))
    axes.set_yticklabels([f"rank {rank}" for rank in reversed(range(schedule.pp))])
    axes.set_xlabel("time (units of the given costs)")
    for side in ("top", "right", "left"):
        axes.spines[side].set_visible(False)
    axes.tick_params(axis="y", length=0)

    heading = title or (schedule_spec(schedule.name).title if schedule.name != CSV_SCHEDULE else "pipeline order from a file")
    axes.set_title(
        f"{heading}: pp={schedule.pp}"
        + (f", vpp={schedule.vpp}" if schedule.vpp > 1 else "")
        + f", {schedule.microbatches} microbatches; step time {simulation.step_time:g}, "
        f"bubble {simulation.bubble_fraction:.1%}",
        fontsize=11, loc="left",
    )
    used = {part.kind for actions in schedule.ranks for action in actions if action.is_compute
            for part in action.parts()}
    names = {Kind.F: "F forward", Kind.B: "B backward", Kind.I: "I input-grad", Kind.W: "W weight-grad"}
    handles = [Patch(facecolor=COLOURS[kind], label=names[kind]) for kind in COLOURS if kind in used]
    if schedule.vpp > 1:
        handles.append(Patch(facecolor=_lighter("#777777", 0.45), label="lighter: rank's later stage"))
    if any(action.kind is Kind.FB for actions in schedule.ranks for action in actions):
        handles.append(Patch(facecolor="white", edgecolor="#777777", label="split cell: overlapped F&B"))
    if any(end > start for actions, starts, ends in zip(schedule.ranks, simulation.starts, simulation.ends)
           for action, start, end in zip(actions, starts, ends) if not action.is_compute):
        handles.append(Patch(facecolor=TRANSFER_COLOUR, label="transfer"))
    handles.append(Patch(facecolor=IDLE_COLOUR, edgecolor="#d0d0d0", hatch="////", label="idle (bubble)"))
    axes.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16 - 0.3 / schedule.pp),
                ncol=len(handles), frameon=False, fontsize=8.5)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path
