"""The pipeline plan of a training run: which layers each stage holds, and each rank's actions.

Built once by the driver from the config (pure and deterministic, so an actor could rebuild it
and get the same thing) and shipped to the actors, which interpret it every step
(`actors/pipeline/interpreter.py`). The schedule is lowered with send/recv and proven deadlock-free before
any actor starts.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rayshard.plans.pipeline.actions import Schedule
from rayshard.plans.errors import ScheduleError
from rayshard.plans.pipeline.csv_order import CsvOrder, lowered_as_written, pipeline_order, schedule_of
from rayshard.plans.pipeline.checker import check
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.pipeline.lowering import lower
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.plans.pipeline.partition import StagePartition, partition_layers
from rayshard.plans.pipeline.schedules import build_schedule, schedule_spec


CsvRows = tuple[tuple[str, ...], ...]  # a pipeline order file's cells, one tuple per rank


@dataclass(frozen=True)
class PipelinePlan:
    schedule: Schedule  # lowered and checked: schedule.ranks[pp_rank] is that rank's action list
    partition: StagePartition

    def to_dict(self) -> dict:
        return {"schedule": self.schedule.to_dict(),
                "stage_layers": [[layers.start, layers.stop] for layers in self.partition.stage_layers]}


def stage_partition(model: ModelConfig, layout: ParallelLayout, schedule_name: str,
                    stage_layout: Sequence[int] | None = None, csv_rows: CsvRows | None = None) -> StagePartition:
    """Layers per stage: balanced (every layer costs the same), or `stage_layout` layer counts.

    The embedding and head are left out of the balance: on the reference model a layer costs
    far more than either, and an uneven cut is one `stage_layout` away. csv_rows: a pipeline
    order from a file, whose stage placement decides (`plans/pipeline/csv_order.py`).
    """
    placement = pipeline_order(csv_rows).placement if csv_rows else schedule_spec(schedule_name).placement
    return partition_layers([1.0] * model.n_layers, layout.pp, layout.vpp, placement,
                            layout=list(stage_layout) if stage_layout is not None else None)


def lowered_order(order: CsvOrder) -> Schedule:
    """A pipeline order from a file, lowered: its own transfers where it writes them, else ours."""
    return lowered_as_written(order) if order.has_transfers else lower(schedule_of(order))


def check_order_file(order: CsvOrder) -> None:
    """Lower and check a file's order before a run starts, so a deadlock or a missing transfer is
    named with the file (the run's config keeps only the cells)."""
    try:
        check(lowered_order(order)).raise_if_failed()
    except ScheduleError as error:
        message = str(error)
        raise ScheduleError(message if message.startswith(order.source) else f"{order.source}: {message}") from None


def build_pipeline_plan(model: ModelConfig, layout: ParallelLayout, schedule_name: str, microbatches: int,
                        stage_layout: Sequence[int] | None = None, csv_rows: CsvRows | None = None) -> PipelinePlan:
    """Generate (or read from `csv_rows`), lower and check the schedule; raises
    ScheduleError/ConfigError with a fix."""
    partition = stage_partition(model, layout, schedule_name, stage_layout, csv_rows)
    if csv_rows:
        lowered = lowered_order(pipeline_order(csv_rows))
    else:
        lowered = lower(build_schedule(schedule_name, layout.pp, microbatches, layout.vpp))
    check(lowered).raise_if_failed()
    return PipelinePlan(lowered, partition)
