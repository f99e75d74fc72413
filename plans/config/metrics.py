"""The metrics section: where step metrics go besides metrics.jsonl and the console."""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.options import option


@dataclass(frozen=True)
class MetricsConfig:
    """TensorBoard event files under the run directory; Weights & Biases (needs the wandb
    package) under a project name. Whether wandb is installed is the driver's check
    (cluster/run/metrics_sinks.py): a plan does not look at the machine."""

    tensorboard: bool = option(False, help="write TensorBoard event files under the run directory (tensorboard/)")
    wandb_project: str | None = option(None, metavar="NAME", help="also log step metrics to Weights & Biases (needs wandb)")
