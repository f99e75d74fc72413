"""The model section: which model trains, and what a layout must meet to hold it."""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.options import file_only, option
from rayshard.plans.training.model_plan import check_tp_divides
from rayshard.plans.training.model_spec import PRESETS, ModelConfig, check_experts_fit, preset


@dataclass(frozen=True)
class ModelChoice:
    """Which model: a preset's name (or, for a user's model, its factory) and the shape it gives.

    In a config file the section is the preset plus any of the shape's fields to change
    (`model: {preset: tiny, vocab_size: 512}`), or the preset's name alone (`model: small`); a
    user's model is `model: {factory: package.module:function}` (or --model-factory), which the
    CLI describes on the meta device, since building it is not a plan's job.
    """

    preset: str = option("tiny", flag="--model", metavar="PRESET", help="model preset: tiny | small")
    spec: ModelConfig = file_only(default_factory=lambda: PRESETS["tiny"])

    @classmethod
    def named(cls, name: str, **changes) -> "ModelChoice":
        """A preset by name, with any of its fields changed."""
        return cls(name, preset(name, **changes))

    def validate(self, layout: ParallelLayout) -> None:
        """The shape itself, and that the layout can cut it: tp splits heads, hidden units and the
        vocabulary evenly, the pipeline has a layer per stage, the experts split over ep."""
        m = self.spec
        m.validate()
        if m.user is not None:
            check_tp_divides(m.user, layout.tp)
        elif m.n_kv_heads % layout.tp:
            raise ConfigError("layout.tp", layout.tp, f"must divide the number of kv heads ({m.n_kv_heads})",
                              f"use --tp in {_divisors(m.n_kv_heads)}")
        if m.user is None and m.ffn_dim % layout.tp:
            raise ConfigError("layout.tp", layout.tp, f"must divide model.ffn_dim ({m.ffn_dim})",
                              f"use --tp in {_divisors(m.ffn_dim)}")
        if m.user is None and m.vocab_size % layout.tp:
            raise ConfigError("layout.tp", layout.tp,
                              f"must divide model.vocab_size ({m.vocab_size}) for the vocab-parallel embedding",
                              f"use --tp in {_divisors(m.vocab_size)}")
        if layout.pp * layout.vpp > m.n_layers:
            raise ConfigError("layout.pp", layout.pp,
                              f"pp*vpp = {layout.pp * layout.vpp} stages exceed the model's {m.n_layers} layers",
                              "lower --pp/--vpp or use a deeper model")
        check_experts_fit(m, layout)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
