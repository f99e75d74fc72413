"""Measured pipeline timings of a run, for the simulator: `<run>/pipeline_timings.json`.

Each rank's interpreter times every compute action (F, B, I, W, FB) of every step. The driver
keeps one representative rank per pipeline rank (data and tensor coordinates 0: the others run
the same actions on equal shapes), drops the first step of the session (warm-up: allocations,
lazy initialisation), and writes the median per action. `rayshard plan schedule --costs-from RUN`
reads the file back into simulator costs.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

import fsspec

from rayshard.plans.pipeline.actions import Schedule
from rayshard.plans.pipeline.csv_order import CSV_SCHEDULE
from rayshard.plans.config import TrainConfig
from rayshard.plans.run_names import run_name_problem
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import RankCoords
from rayshard.plans.pipeline.schedules import schedule_spec
from rayshard.plans.pipeline.simulator import PipelineCosts, costs_from_measurements

if TYPE_CHECKING:  # a rank's report; importing it would bring torch into `rayshard plan`
    from rayshard.actors.training.reports import StepMetrics

FILE_NAME = "pipeline_timings.json"
WARMUP_STEPS = 1


class PipelineTimings:
    def __init__(self, config: TrainConfig):
        self.config = config
        layout = config.layout
        self.enabled = layout.pp > 1
        self.representatives = [layout.rank_of(RankCoords(pp=p, dp=0, fsdp=0, tp=0)) for p in range(layout.pp)]
        self.seen = 0
        self.samples: dict[tuple[str, int, int], list[float]] = {}
        self.plan_seconds: list[float] = []
        self.step_seconds: list[float] = []

    def add(self, per_rank: list[StepMetrics], step_seconds: float) -> None:
        if not self.enabled:
            return
        self.seen += 1
        if self.seen <= WARMUP_STEPS:
            return
        self.step_seconds.append(step_seconds)
        self.plan_seconds.append(max(metrics.pipeline.plan_seconds for metrics in per_rank))
        for rank in self.representatives:
            for key, seconds in per_rank[rank].pipeline.action_seconds.items():
                self.samples.setdefault(key, []).append(seconds)

    def to_dict(self) -> dict:
        config = self.config
        return {
            "schedule": config.pipeline.schedule, "layout": config.layout.to_dict(),
            "microbatches": config.pipeline.microbatches,
            "model_preset": config.model.preset, "global_batch": config.global_batch, "seq_len": config.seq_len,
            "steps_measured": len(self.step_seconds),
            "median_step_seconds": statistics.median(self.step_seconds),
            "median_plan_seconds": statistics.median(self.plan_seconds),
            "actions": [[kind, stage, mb, statistics.median(values)]
                        for (kind, stage, mb), values in sorted(self.samples.items())],
        }

    def write(self, store) -> None:
        if self.enabled and self.step_seconds:
            store.write_text(f"{self.config.run}/{FILE_NAME}", json.dumps(self.to_dict(), indent=1))


def read_durations(record: dict) -> dict[tuple[str, int, int], float]:
    """The {(kind, stage, microbatch): seconds} table `rayshard.plans.pipeline.simulator` takes."""
    return {(kind, int(stage), int(mb)): float(seconds) for kind, stage, mb, seconds in record["actions"]}


@dataclass
class MeasuredCosts:
    """A run's measured timings, as the simulator's inputs (`rayshard plan schedule --costs-from`)."""

    source: str
    schedule: str
    pp: int
    vpp: int
    microbatches: int
    durations: dict[tuple[str, int, int], float]
    plan_seconds: float
    step_seconds: float

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @classmethod
    def load(cls, ref: str, store: str = "./runs") -> "MeasuredCosts":
        """ref: a pipeline_timings.json file, a run directory, or a run name in `store`."""
        candidates = [ref] if ref.endswith(".json") else [f"{ref.rstrip('/')}/{FILE_NAME}"] + (
            [] if run_name_problem(ref) else [f"{store.rstrip('/')}/{ref}/{FILE_NAME}"])  # only a run name is looked up in the store
        for url in candidates:
            fs, path = fsspec.core.url_to_fs(url)
            if fs.exists(path):
                record = _timings_record(fs.cat_file(path), url, ref)
                break
        else:
            raise ConfigError("--costs-from", ref, f"no {FILE_NAME} found (looked at {', '.join(candidates)})",
                              "name a run trained with --pp 2 or more (its driver writes the file), its "
                              "directory, or the JSON file itself; use --store for runs outside ./runs")
        layout = record["layout"]
        try:
            return cls(url, record["schedule"], int(layout["pp"]), int(layout.get("vpp", 1)), int(record["microbatches"]),
                       read_durations(record), float(record["median_plan_seconds"]), float(record["median_step_seconds"]))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ConfigError("--costs-from", ref, f"{url} lacks or garbles a field the timings need ({error!r})",
                              "retrain the run with --pp 2 or more to write it again, or name another run") from None

    @property
    def trained_from_file(self) -> bool:
        """The run executed a pipeline order read from a file (`train --schedule-csv`)."""
        return self.schedule == CSV_SCHEDULE

    def same_plan(self, schedule: Schedule) -> bool:
        name = CSV_SCHEDULE if self.trained_from_file else schedule_spec(self.schedule).name
        return (name == schedule.name and schedule.pp == self.pp
                and schedule.vpp == self.vpp and schedule.microbatches == self.microbatches)

    def costs_for(self, schedule: Schedule) -> PipelineCosts:
        """Per-stage mean costs; for a different stage count, the same model cut into
        schedule.num_stages equal stages (each stage's costs scale with its share of layers)."""
        measured = costs_from_measurements(self.durations, self.num_stages)
        if schedule.num_stages == self.num_stages:
            return measured
        scale = self.num_stages / schedule.num_stages
        stages = measured.stages
        mean = {name: sum(getattr(stage, name) for stage in stages) / len(stages)
                for name in ("forward", "backward", "weight_grad")}
        return PipelineCosts.uniform(schedule.num_stages, mean["forward"] * scale, mean["backward"] * scale,
                                     mean["weight_grad"] * scale)

    def describe(self, schedule: Schedule) -> str:
        costs = self.costs_for(schedule)
        how = ("every action's own median time" if self.same_plan(schedule)
               else f"per-stage means{' rescaled to ' + str(schedule.num_stages) + ' stages' if schedule.num_stages != self.num_stages else ''}")
        return (f"costs measured by {self.schedule} pp={self.pp} vpp={self.vpp} m={self.microbatches} "
                f"({self.source}); using {how}; stage 0: {costs.describe()} (seconds)")


def _timings_record(data: bytes, url: str, ref: str) -> dict:
    """The JSON object of a pipeline_timings.json, or a ConfigError naming the file."""
    try:
        record = json.loads(data)
    except ValueError as error:
        raise ConfigError("--costs-from", ref, f"{url} is not valid JSON ({error})",
                          "retrain the run with --pp 2 or more to write it again, or name another run") from None
    if not isinstance(record, dict) or not isinstance(record.get("layout"), dict):
        raise ConfigError("--costs-from", ref, f"{url} is not a pipeline timings record (no layout object)",
                          "name a run trained with --pp 2 or more, or its pipeline_timings.json")
    return record
