"""The dpo section: Direct Preference Optimization's settings (`--objective dpo`).

The loss of a pair, z = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))
(sums over the response tokens): sigmoid, -(1 - s) log sigmoid(beta z) - s log sigmoid(-beta z)
with s the label smoothing (Rafailov et al. 2023; s > 0 is the "conservative" DPO); ipo,
(z - 1 / (2 beta))^2 (Azar et al. 2023). The rewards reported are beta (log pi - log ref).
"""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.options import file_only, option

DPO_LOSSES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class DpoConfig:
    beta: float = option(0.1, flag="--dpo-beta", metavar="B",
                         help="DPO's beta: how far the policy may move from the reference (default 0.1)")
    loss: str = option("sigmoid", flag="--dpo-loss", choices=DPO_LOSSES,
                       help="sigmoid: the DPO paper's loss (default); ipo: IPO's squared loss")
    label_smoothing: float = option(0.0, flag="--dpo-label-smoothing", metavar="S",
                                    help="sigmoid loss: the probability that a pair's preference is flipped (0 to 0.5)")
    precomputed: bool = option(False, flag="--dpo-precomputed",
                               help="read the reference's log-probabilities from the dataset (`rayshard data "
                                    "reference-logprobs`) instead of running the reference each step")
    # --dpo-precomputed: the dataset's file of this run's reference (relative to the dataset, e.g.
    # reference-logprobs/<digest>.parquet), picked by the driver before the ranks start
    # (cluster/run/reference_logprobs.py, decision 201); whatever a file sets is replaced.
    logprobs_file: str | None = file_only(None)

    def validate(self) -> None:
        if not self.beta > 0:
            raise ConfigError("dpo.beta", self.beta, "must be positive", "set --dpo-beta 0.1, say")
        if self.loss not in DPO_LOSSES:
            raise ConfigError("dpo.loss", self.loss, "is not a DPO loss", f"set --dpo-loss to one of {', '.join(DPO_LOSSES)}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError("dpo.label_smoothing", self.label_smoothing, "must be in [0, 0.5)",
                              "set --dpo-label-smoothing 0, or 0.1, say")
        if self.label_smoothing and self.loss != "sigmoid":
            raise ConfigError("dpo.label_smoothing", self.label_smoothing, f"applies to the sigmoid loss, not {self.loss}",
                              "set --dpo-label-smoothing 0, or --dpo-loss sigmoid")
