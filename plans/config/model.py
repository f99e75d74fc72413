"""The model section: which model trains, and what a layout must meet to hold it."""
from __future__ import annotations

from dataclasses import dataclass, replace

from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.options import file_only, option
from rayshard.plans.training.model_spec import PRESETS, ModelConfig, check_experts_fit, preset
from rayshard.plans.training.tp_fit import TpSplit, check_tp_fits


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
    # The vocabulary the user set (the file's model.vocab_size or --vocab-size), applied to spec;
    # None: the preset's, or with --data a prepared dataset's (cluster/data/training_data.py).
    vocab_size: int | None = option(None, metavar="N",
                                    help="the model's vocabulary size (default: the preset's; with --data, the "
                                         "dataset tokenizer's, rounded up so that tp can split it)")

    def __post_init__(self):
        if self.vocab_size is None or self.vocab_size == self.spec.vocab_size:
            return
        if self.spec.user is not None:
            raise ConfigError("model.vocab_size", self.vocab_size, f"sets a built-in model's vocabulary, and "
                              f"{self.spec.user.factory} builds its own", "drop --vocab-size, or change the factory's model")
        object.__setattr__(self, "spec", replace(self.spec, vocab_size=self.vocab_size))

    @classmethod
    def named(cls, name: str, **changes) -> "ModelChoice":
        """A preset by name, with any of its fields changed."""
        return cls(name, preset(name, **changes))

    def validate(self, layout: ParallelLayout, tp_also: tuple[TpSplit, ...] = ()) -> None:
        """The shape itself, and that the layout can cut it: tp divides every size it splits (heads,
        hidden units, the vocabulary, and `tp_also`: what the rest of the run asks of tp), the
        pipeline has a layer per stage, the experts split over ep."""
        m = self.spec
        m.validate()
        check_tp_fits(m, layout.tp, "layout.tp", "--tp", tp_also)
        if layout.pp * layout.vpp > m.n_layers:
            raise ConfigError("layout.pp", layout.pp,
                              f"pp*vpp = {layout.pp * layout.vpp} stages exceed the model's {m.n_layers} layers",
                              "lower --pp/--vpp or use a deeper model")
        check_experts_fit(m, layout)
