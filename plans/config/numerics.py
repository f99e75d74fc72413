"""The numerics section: how each step computes, whatever the layout (docs/decisions.md,
"Training at real precision")."""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.options import option
from rayshard.plans.training.model_spec import ModelConfig

PRECISIONS = ("fp32", "bf16")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass(frozen=True)
class NumericsConfig:
    """Precision, activation checkpointing, compilation and sequence parallelism.

    precision "bf16": bf16 compute, float32 master weights, moments and gradient reduction;
    checkpoints always hold the float32 state. ac: activation checkpointing per transformer block
    ("selective" keeps matmul outputs and recomputes the rest). compile: torch.compile per block.
    sequence_parallel: with tp, norms and the residual stream split over the sequence. None of
    them changes what is learned beyond rounding; each trades memory, time or both.
    """

    precision: str = option("fp32", choices=PRECISIONS,
                            help="bf16: bf16 compute with float32 master weights, moments and gradient reduction "
                                 "(default fp32)")
    ac: str = option("none", choices=ACTIVATION_CHECKPOINTING,
                     help="activation checkpointing per transformer block; selective keeps matmul outputs (default none)")
    compile: bool = option(False, help="torch.compile each transformer block")
    sequence_parallel: bool = option(False, flag="--sp",
                                     help="sequence parallelism with --tp: norms and the residual stream split over "
                                          "the sequence")

    def validate(self, model: ModelConfig, layout: ParallelLayout, seq_len: int) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError("precision", self.precision, f"must be one of {list(PRECISIONS)}", "pass --precision fp32 or bf16")
        if self.sequence_parallel:
            self._validate_sequence_parallel(model, layout, seq_len)
        if self.ac not in ACTIVATION_CHECKPOINTING:
            raise ConfigError("ac", self.ac, f"must be one of {list(ACTIVATION_CHECKPOINTING)}",
                              "pass --ac none, full or selective")

    @staticmethod
    def _validate_sequence_parallel(model: ModelConfig, layout: ParallelLayout, seq_len: int) -> None:
        """The sequence splits over the tp ranks, evenly, on a model whose plan says how."""
        if model.is_moe:
            raise ConfigError("sequence_parallel", True, "is not supported with mixture-of-experts layers yet",
                              "drop --sp for MoE models")
        if model.user is not None and not model.user.plan.sequence_parallel:
            raise ConfigError("sequence_parallel", True, f"the plan of {model.user.factory} declares no sequence parallelism",
                              "add its norms and sequence gathers to the plan's sequence_parallel, or drop --sp")
        if layout.tp == 1:
            raise ConfigError("sequence_parallel", True, "splits the sequence over the tp ranks, and tp is 1",
                              "add --tp 2 (or more), or drop --sp")
        if seq_len % layout.tp:
            raise ConfigError("seq_len", seq_len, f"must be a multiple of tp ({layout.tp}) under sequence parallelism",
                              f"set --seq-len to a multiple of {layout.tp}")
