"""The continuity picture: a run's loss on layout A, its resume on layout B, over an uninterrupted run.

Reads `{store}/{run}/metrics.jsonl` (one JSON line per step: step, loss, layout) of each run
given (a later run cuts an earlier one where it starts: resuming into a new run name continues
the timeline); consecutive steps on the same layout form a segment, each drawn in its own colour, with
the uninterrupted reference in grey underneath and, below, the relative difference per step on a
log scale next to the 1e-5 bar.
"""
from __future__ import annotations

from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")  # headless: no display on cluster nodes or in CI

import matplotlib.pyplot as plt  # noqa: E402

from rayshard.cluster.run.json_lines import json_records
from rayshard.plans.training.metrics_timeline import current_timeline
from rayshard.plans.errors import CheckpointError
from rayshard.plans.layout.parallel_layout import ParallelLayout

COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


@dataclass
class Segment:
    run: str
    layout: str
    steps: list[int]
    losses: list[float]

    @property
    def label(self) -> str:
        try:
            described = ParallelLayout.parse(self.layout).describe()
        except Exception:  # an unknown layout string is still worth a label
            described = self.layout
        return f"{self.run}: {described} (steps {self.steps[0]}-{self.steps[-1]})"


def read_metrics(store, run: str) -> list[dict]:
    text = store.read_text(f"{run}/metrics.jsonl")
    if text is None:
        raise CheckpointError(f"run {run!r} has no metrics.jsonl in {store.url}; train it first (or check --store)")
    where = f"{store.url}/{run}/metrics.jsonl"
    # Lines are appended by every attempt: the current timeline holds each step once.
    records = current_timeline([r for r in json_records(text, where) if _number(r.get("loss"))])
    if not records:
        raise CheckpointError(f"{where}: holds no step records with a loss; nothing to draw. Fix: train the run "
                              "(or check --store)")
    return records


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def segments(run: str, records: list[dict]) -> list[Segment]:
    result: list[Segment] = []
    for record in sorted(records, key=lambda r: r["step"]):
        layout = str(record.get("layout", "?"))
        if not result or result[-1].layout != layout:
            result.append(Segment(run, layout, [], []))
        result[-1].steps.append(int(record["step"]))
        result[-1].losses.append(float(record["loss"]))
    return result


def relative_differences(parts: list[Segment], reference: dict[int, float]) -> dict[int, float]:
    return {step: abs(loss - reference[step]) / abs(reference[step])
            for part in parts for step, loss in zip(part.steps, part.losses) if step in reference and reference[step]}


def _timeline(store, runs: list[str]) -> list[tuple[str, list[dict]]]:
    """Each run's records, cut where the next run takes over (a run resumed into a new run name
    continues the earlier one from its first step)."""
    records = [read_metrics(store, run) for run in runs]
    timeline = []
    for index, (run, lines) in enumerate(zip(runs, records)):
        later = [min(int(r["step"]) for r in nxt) for nxt in records[index + 1:] if nxt]
        cut = min(later, default=None)
        timeline.append((run, [r for r in lines if cut is None or int(r["step"]) < cut]))
    return timeline


def plot_resume(store, runs: list[str], out: str, reference: str | None = None, title: str | None = None) -> dict:
    """Draw the picture to `out` (PNG); return the largest relative difference to the reference."""
    parts = [part for run, records in _timeline(store, runs) for part in segments(run, records)]
    ref = {int(r["step"]): float(r["loss"]) for r in read_metrics(store, reference)} if reference else {}
    differences = relative_differences(parts, ref) if ref else {}
    figure, axes = plt.subplots(2 if ref else 1, 1, figsize=(9, 6.5 if ref else 4.5), sharex=True, squeeze=False,
                                gridspec_kw={"height_ratios": [3, 1.4]} if ref else None)
    top = axes[0][0]
    if ref:
        steps = sorted(ref)
        top.plot(steps, [ref[s] for s in steps], color="#999999", linewidth=5, alpha=0.45,
                 label=f"{reference}: uninterrupted")
    for index, part in enumerate(parts):
        top.plot(part.steps, part.losses, color=COLOURS[index % len(COLOURS)], linewidth=1.6, label=part.label)
        if index:
            top.axvline(part.steps[0] - 0.5, color="#555555", linestyle=":", linewidth=1)
    top.set_ylabel("training loss")
    top.legend(loc="upper right", fontsize=8)
    top.set_title(title or "Loss before and after resuming on another layout")
    top.grid(alpha=0.3)
    if ref:
        bottom = axes[1][0]
        for index, part in enumerate(parts):
            xs = [s for s in part.steps if s in differences]
            # Bit-identical steps have difference 0: drawn at the bottom of the log axis.
            bottom.scatter(xs, [max(differences[s], 1e-12) for s in xs], s=6, color=COLOURS[index % len(COLOURS)])
        bottom.axhline(1e-5, color="#d62728", linestyle="--", linewidth=1, label="1e-5")
        bottom.set_yscale("log")
        bottom.set_ylim(1e-12, 1e-3)
        bottom.set_ylabel("|loss - ref| / ref")
        bottom.legend(loc="upper left", fontsize=8)
        bottom.grid(alpha=0.3)
    axes[-1][0].set_xlabel("step")
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return {"out": out, "max_relative_difference": max(differences.values(), default=0.0), "steps_compared": len(differences),
            "segments": [part.label for part in parts]}
