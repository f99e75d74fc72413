"""The pipeline section: how a rank's batch is cut into microbatches and, with pp > 1, which
schedule runs them over the stages, where the layers are cut, and how long a transfer may wait."""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.options import option
from rayshard.plans.pipeline.csv_order import pipeline_order
from rayshard.plans.pipeline.plan import stage_partition
from rayshard.plans.pipeline.schedules import build_schedule, schedule_spec, valid_microbatch_counts
from rayshard.plans.training.model_spec import ModelConfig


@dataclass(frozen=True)
class PipelineConfig:
    """Microbatches, schedule and stage cut (the schedule and cut apply with pp > 1).

    stage_layout: layer counts per stage (pp * vpp of them) for an uneven cut, e.g. [1, 3]; None
    cuts evenly. schedule_csv: a pipeline order from a file in torch.distributed.pipelining's CSV
    format (its cells, one tuple per rank; plans/pipeline/csv_order.py), run instead of a named
    schedule. timeout_s: how long one transfer (or the step's own all-reduce) may wait before the
    step fails naming rank, step and action; None means resources.collective_timeout_s.
    """

    schedule: str = option("1f1b", metavar="NAME",
                           help="pipeline schedule with --pp > 1: gpipe, 1f1b, interleaved1f1b, zbh1, zbv, dualpipev "
                                "(--vpp defaults to the schedule's: 2 for interleaved1f1b, zbv and dualpipev)")
    microbatches: int = option(1, metavar="N", help="gradient accumulation / pipeline microbatches")
    stage_layout: tuple[int, ...] | None = option(
        None, metavar="N,N,..", help="layers per pipeline stage (pp x vpp counts), e.g. 1,3; default: an even cut")
    schedule_csv: tuple[tuple[str, ...], ...] | None = option(
        None, metavar="FILE", reads_file=True,
        help="run a pipeline order from a file (torch.distributed.pipelining's CSV: one row per rank) "
             "instead of --schedule; --pp, --vpp and --microbatches default to the file's")
    timeout_s: float | None = option(
        None, flag="--pipeline-timeout", metavar="SECONDS",
        help="fail a pipeline step whose transfer waits longer than this (default: the collective timeout)")

    def __post_init__(self):
        if self.stage_layout is not None and not isinstance(self.stage_layout, tuple):
            object.__setattr__(self, "stage_layout", tuple(self.stage_layout))  # YAML gives a list
        if self.schedule_csv is not None and not isinstance(self.schedule_csv, tuple):
            object.__setattr__(self, "schedule_csv", tuple(tuple(row) for row in self.schedule_csv))

    @property
    def splits_backward(self) -> bool:
        """The pipeline order runs each stage's backward as I and W (zero-bubble schedules)."""
        if self.schedule_csv:
            return pipeline_order(self.schedule_csv).splits_backward
        return schedule_spec(self.schedule).splits_backward

    def validate(self, model: ModelConfig, layout: ParallelLayout, global_batch: int, compile_blocks: bool) -> None:
        """Microbatch count, schedule name, stages per rank and stage cut, checked up front."""
        per_rank = global_batch // layout.data_parallel_size
        if self.microbatches < 1 or per_rank % self.microbatches:
            raise ConfigError("microbatches", self.microbatches,
                              f"must divide the per-rank batch ({per_rank} = global_batch / (dp*fsdp))",
                              self._microbatch_fix(layout, per_rank))
        if self.schedule_csv:
            self._validate_order(model, layout, compile_blocks)
        else:
            self._validate_schedule(model, layout, per_rank, compile_blocks)
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ConfigError("pipeline_timeout_s", self.timeout_s, "must be positive (or unset for collective_timeout_s)",
                              "set it to e.g. 300")

    def _validate_schedule(self, model: ModelConfig, layout: ParallelLayout, per_rank: int, compile_blocks: bool) -> None:
        spec = schedule_spec(self.schedule)  # a typo fails even when pp == 1
        if layout.pp == 1:
            if self.stage_layout is not None:
                raise ConfigError("stage_layout", self.stage_layout, "only applies to pipelines (pp > 1)",
                                  "drop stage_layout, or set --pp 2 or more")
            return
        if spec.fixed_vpp and layout.vpp != spec.default_vpp:
            raise ConfigError("layout.vpp", layout.vpp,
                              f"the {spec.title} schedule runs exactly {spec.default_vpp} stage(s) per rank",
                              f"use --vpp {spec.default_vpp}, or interleaved1f1b for other vpp")
        if compile_blocks and spec.splits_backward:
            raise ConfigError("compile", True, f"the {spec.title} schedule splits each stage's backward into input and "
                              "weight halves, which cannot see inside a compiled block's backward",
                              "drop --compile, or use --schedule 1f1b, gpipe or interleaved1f1b")
        if not spec.accepts(layout.pp, layout.vpp, self.microbatches):
            raise ConfigError("microbatches", self.microbatches,
                              f"{spec.title} on pp={layout.pp}" + (f" with vpp={layout.vpp}" if layout.vpp > 1 else "")
                              + f" needs {spec.counts_rule.format(two_pp=2 * layout.pp)}",
                              self._microbatch_fix(layout, per_rank))
        build_schedule(spec.name, layout.pp, self.microbatches, layout.vpp)
        try:
            stage_partition(model, layout, spec.name, self.stage_layout)
        except ConfigError as error:
            if error.field != "layout":
                raise
            raise ConfigError("stage_layout", self.stage_layout, error.constraint, error.fix) from None

    def _microbatch_fix(self, layout: ParallelLayout, per_rank: int) -> str:
        """The microbatch counts that both divide the per-rank batch and suit the pipeline
        schedule, or, where none does, the smallest global batch with one: so that following one
        error's fix never runs into the other's."""
        spec = schedule_spec(self.schedule) if layout.pp > 1 and not self.schedule_csv else None
        if spec is None or (spec.fixed_vpp and layout.vpp != spec.default_vpp):  # the vpp error comes first
            return f"use --microbatches in {_divisors(per_rank)}"
        fitting = [m for m in valid_microbatch_counts(spec.name, layout.pp, layout.vpp, up_to=per_rank) if per_rank % m == 0]
        if fitting:
            return f"use --microbatches in {fitting}"
        served = valid_microbatch_counts(spec.name, layout.pp, layout.vpp, up_to=64 * layout.pp * layout.vpp)
        if not served:
            return f"use another --schedule: {spec.title} serves no microbatch count on pp={layout.pp}"
        smallest = served[0]
        return (f"no count divides the per-rank batch ({per_rank}) and suits {spec.title} on pp={layout.pp}: raise "
                f"--global-batch to a multiple of {smallest * layout.data_parallel_size} and use --microbatches {smallest}")

    def _validate_order(self, model: ModelConfig, layout: ParallelLayout, compile_blocks: bool) -> None:
        """A pipeline order from a file: its ranks, stages and microbatches must be the run's."""
        order = pipeline_order(self.schedule_csv)
        if layout.pp == 1:
            raise ConfigError("layout.pp", 1, "a schedule file orders pipeline stages, and pp is 1",
                              f"set --pp {order.pp} (the file's rows), or drop --schedule-csv")
        for name, ours, theirs in (("layout.pp", layout.pp, order.pp), ("layout.vpp", layout.vpp, order.vpp),
                                   ("microbatches", self.microbatches, order.microbatches)):
            if ours != theirs:
                raise ConfigError(name, ours, f"the schedule file has {theirs}", f"set {name} to {theirs}, or edit the file")
        if compile_blocks and order.splits_backward:
            raise ConfigError("compile", True, "the schedule file splits backwards into I and W, which cannot see "
                              "inside a compiled block's backward", "drop --compile, or write B instead of I/W")
        order.placement  # raises, naming the placement, when layers cannot be cut for it
        stage_partition(model, layout, "1f1b", self.stage_layout, self.schedule_csv)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
