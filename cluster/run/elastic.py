"""Elastic training: the controller driving real Ray rank groups.

Each attempt asks Ray what the cluster has now, lets the layout chooser pick a layout for it
(user-pinned dimensions kept), and runs `train` with `resume=auto`: the first attempt starts
the run (or continues it, if the run name already has checkpoints — a resubmitted job or a new
driver after the old one died), later attempts resume from LATEST and reshard onto the new
layout. A dead rank, a lost node or an unrecoverable step error ends the attempt; the failure
policy decides whether to go again. More ranks appearing triggers a resize at the next checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.run.controller import Controller, Outcome, RunResult
from cluster.run.rank_group import StepFailed, connect_ray
from cluster.run.train import train
from plans.config import TrainConfig
from plans.elastic import FailurePolicy, ScalingPolicy
from plans.layout.parallel_layout import ParallelLayout
from plans.layout.chooser import Workload, choose_layout

# What a rank losing its process or node, or an unrecoverable step, looks like from the driver.
RANK_FAILURES = (RayActorError, RayTaskError, GetTimeoutError, StepFailed)


@dataclass
class TrainingWorkerGroup:
    config: TrainConfig
    cpus_per_rank: float = 1.0

    def available_ranks(self) -> int:
        resources = ray.cluster_resources()
        if resources.get("GPU", 0) >= 1:
            return int(resources["GPU"])
        return int(resources.get("CPU", 0) // self.cpus_per_rank)

    def run(self, layout: ParallelLayout, should_resize) -> RunResult:
        config = replace(self.config, layout=layout, resume="auto")
        try:
            result = train(config, stop_after_checkpoint=lambda step: should_resize())
        except RANK_FAILURES as error:
            return RunResult(Outcome.FAILED, error, f"{type(error).__name__}: {_first_line(error)}")
        if result.stopped_early:
            return RunResult(Outcome.RESIZE, detail=f"more ranks available; resizing after step {max(result.losses)}")
        return RunResult(Outcome.FINISHED, detail=f"step {config.steps} reached")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0][:300]


def layout_chooser_for(config: TrainConfig, pinned: dict[str, int], memory_per_rank_bytes: float, ranks_per_node: int):
    work = Workload(config.global_batch, config.seq_len, config.microbatches)

    def choose(ranks: int):
        return choose_layout(ranks, config.model, work, memory_per_rank_bytes, ranks_per_node=ranks_per_node,
                             pinned=pinned)

    return choose


def train_elastic(config: TrainConfig, pinned: dict[str, int], scaling: ScalingPolicy, failure: FailurePolicy,
                  memory_per_rank_bytes: float = 64 * 2**30, ranks_per_node: int = 8, cpus_per_rank: float = 1.0):
    connect_ray()
    group = TrainingWorkerGroup(config, cpus_per_rank)
    controller = Controller(group, layout_chooser_for(config, pinned, memory_per_rank_bytes, ranks_per_node),
                            failure_policy=failure, scaling_policy=scaling)
    return controller, controller.run()
