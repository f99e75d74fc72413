"""The lora section: low-rank adapters on a frozen base (plans/training/lora.py says what they are)."""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.options import option
from rayshard.plans.training.lora import LORA_TARGETS


@dataclass(frozen=True)
class LoraConfig:
    """rank 0: no adapters, every parameter trains. rank R > 0: the base is frozen and each target
    projection W gets W + (alpha / R) * B @ A, A [R, in] and B [out, R] trained (B starts at zero,
    so step 0 computes the base). targets: comma-separated logical projections. base: the
    checkpoint holding the frozen weights (RUN, RUN@STEP or a URL); None: the seeded initial
    weights (`seed`), which tests use. Checkpoints of the run hold only the adapters, their moments
    and the step, and name the base and its digest."""

    rank: int = option(0, flag="--lora-rank", metavar="R", help="LoRA rank (0: no adapters, full fine-tuning)")
    alpha: float = option(16.0, flag="--lora-alpha", metavar="A", help="LoRA scale numerator: adapters add (alpha/rank) B A")
    dropout: float = option(0.0, flag="--lora-dropout", metavar="P", help="dropout on the adapters' input")
    targets: str = option(",".join(LORA_TARGETS), flag="--lora-targets", metavar="LIST",
                          help="comma-separated projections to adapt: q,k,v,o,gate,up,down; on a user's model "
                               "(--model-factory) module-name patterns, or names its plan's lora_targets gives")
    base: str | None = option(None, flag="--lora-base", metavar="CKPT",
                              help="checkpoint with the frozen base weights (RUN, RUN@STEP, URL); default: the seeded init")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def target_list(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    def validate(self, user_model: bool = False) -> None:
        """user_model: targets are module-name patterns (checked against the model by
        `plans/training/lora.py`), not the built-in decoder's projection names."""
        if self.rank < 0:
            raise ConfigError("lora.rank", self.rank, "must be 0 (off) or positive", "set --lora-rank 8, say, or 0")
        if not self.enabled:
            return
        if not self.alpha > 0:
            raise ConfigError("lora.alpha", self.alpha, "must be positive", "set --lora-alpha, e.g. 16 (often 2 x rank)")
        if not 0 <= self.dropout < 1:
            raise ConfigError("lora.dropout", self.dropout, "must be in [0, 1)", "set --lora-dropout 0.05, say, or 0")
        targets = self.target_list
        if user_model:
            if not targets:
                raise ConfigError("lora.targets", self.targets, "names nothing", "give module-name patterns, e.g. "
                                  "--lora-targets 'blocks.*.attn.q,blocks.*.attn.v'")
            return
        routed = [t for t in targets if t.startswith("expert")]
        if routed:
            raise ConfigError("lora.targets", self.targets, "adapters on routed experts are not supported (gate, up and "
                              "down adapt an MoE layer's shared expert and the dense layers)",
                              f"leave {','.join(routed)} out, e.g. --lora-targets q,k,v,o,gate,up,down")
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets:
            raise ConfigError("lora.targets", self.targets, f"names {unknown or 'nothing'}; the projections that exist "
                              f"are {','.join(LORA_TARGETS)}", "list some of those, e.g. --lora-targets q,v")
        if len(set(targets)) != len(targets):
            raise ConfigError("lora.targets", self.targets, "names a projection twice", "list each once")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank
