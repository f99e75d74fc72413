"""TrainConfig: the job's own settings, its sections, and how they are built and checked together.

Built from plain data (a YAML file's contents plus CLI overrides); validation errors name the
field, the constraint and a fix. Pure: reading the file is the CLI's job.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from rayshard.plans.config.checkpoint import CheckpointConfig
from rayshard.plans.config.data import DataConfig
from rayshard.plans.config.dpo import DpoConfig
from rayshard.plans.config.flat_keys import sectioned
from rayshard.plans.config.lora import LoraConfig
from rayshard.plans.config.metrics import MetricsConfig
from rayshard.plans.config.model import ModelChoice
from rayshard.plans.config.numerics import NumericsConfig
from rayshard.plans.config.optimizer import OptimizerConfig
from rayshard.plans.config.pipeline import PipelineConfig
from rayshard.plans.config.resources import ResourcesConfig
from rayshard.plans.config.values import checked_section
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.options import option, section, sections
from rayshard.plans.run_names import RUN_NAME, check_run_name
from rayshard.plans.training.lora import check_lora_fits, check_user_lora_under_tp
from rayshard.plans.training.rope_scaling import longest_sequence
from rayshard.plans.training.model_spec import PRESETS, ModelConfig, preset
from rayshard.plans.training.tp_fit import TpSplit



OBJECTIVES = ("lm", "sft", "dpo")


@dataclass(frozen=True)
class TrainConfig:
    """One training job.

    The top level is the job itself: its name and home (run, store) and what it trains (steps of
    global_batch sequences of seq_len tokens, every random draw seeded by seed and the step).
    These are what every section serves and what a person changes most, so they stay one word
    away (`config.steps`, `--steps`). Everything else lives in a section: model, layout (the
    parallel degrees), pipeline, numerics, data, optimizer, checkpoint, resources, metrics.
    """

    run: str = option("demo", metavar="NAME", help="run name within the store")
    store: str = option("./runs", metavar="URL", help="store URL: a directory, file://, s3://bucket/prefix, memory://")
    steps: int = option(20, metavar="N", help="train until this many steps are done")
    global_batch: int = option(8, metavar="N", help="sequences per step over all data ranks")
    seq_len: int = option(64, metavar="N", help="tokens per sequence")
    seed: int = option(1234, metavar="N", help="seed of the initial weights and the sample order")
    objective: str = option("lm", choices=OBJECTIVES,
                            help="lm: next-token loss over every token (default); sft: the mean loss over the global "
                                 "batch's completion tokens of a `data prepare --format sft` dataset; dpo: the DPO loss "
                                 "over the pairs of a `data prepare --format preference` dataset (--dpo-*)")
    model: ModelChoice = section(ModelChoice, "which model trains")
    layout: ParallelLayout = section(ParallelLayout, "how the ranks split the work: dp x fsdp x tp x pp (vpp, ep)")
    pipeline: PipelineConfig = section(PipelineConfig, "microbatches and, with --pp > 1, the schedule and stage cut")
    numerics: NumericsConfig = section(NumericsConfig, "precision and speed")
    data: DataConfig = section(DataConfig, "where the tokens come from")
    optimizer: OptimizerConfig = section(OptimizerConfig, "AdamW and its learning-rate schedule")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "when to save, how, and what to resume from")
    resources: ResourcesConfig = section(ResourcesConfig, "what each rank asks of the cluster, and how long to wait")
    metrics: MetricsConfig = section(MetricsConfig, "where step metrics go besides metrics.jsonl")
    lora: LoraConfig = section(LoraConfig, "low-rank adapters on a frozen base (--lora-rank > 0)")
    dpo: DpoConfig = section(DpoConfig, "--objective dpo: beta, loss and label smoothing")

    def __post_init__(self):
        if isinstance(self.model, ModelConfig):  # the shape alone, as TrainConfig took it before the sections
            raise TypeError("TrainConfig(model=...) takes a ModelChoice: wrap the shape as ModelChoice(spec=...), "
                            "or name a preset with ModelChoice.named('tiny')")

    def validate(self) -> "TrainConfig":
        """Every section's constraints, the model and the layout first: most others read them."""
        self.model.validate(self.layout, self._tp_limits())
        self.resources.validate(self.layout)
        self._validate_batch()
        self.pipeline.validate(self.model.spec, self.layout, self.global_batch, self.numerics.compile)
        self.checkpoint.validate()
        check_run_name(self.run, "run")
        self.optimizer.validate()
        self.data.validate(self.seq_len)
        self._validate_objective()
        self.numerics.validate(self.model.spec, self.layout, self.seq_len)
        self._validate_lora()
        return self

    def _validate_objective(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ConfigError("objective", self.objective, "is not an objective", "set objective: lm, sft or dpo")
        if self.objective != "lm" and self.model.spec.user is not None:
            raise ConfigError("objective", self.objective, "a user model's own loss cannot take the completion mask yet",
                              f"train a built-in or imported model with --objective {self.objective}, or use --objective lm")
        if self.objective != "dpo":
            return
        self.dpo.validate()
        rows = 2 * self.layout.data_parallel_size * self.pipeline.microbatches
        if self.global_batch % rows:
            raise ConfigError("global_batch", self.global_batch, f"under dpo counts sequences, two per pair, and every data "
                              f"rank's microbatch must hold whole pairs: a multiple of 2 x dp*fsdp x microbatches = {rows}",
                              f"set --global-batch to a multiple of {rows}")

    def _validate_lora(self) -> None:
        """The adapters against the model, and what LoRA does not run on yet, in one line each."""
        if not self.lora.enabled:
            return
        check_lora_fits(self.model.spec, self.lora)
        if self.model.spec.user is not None and self.layout.tp > 1:
            check_user_lora_under_tp(self.model.spec, self.lora)

    def _tp_limits(self) -> tuple[TpSplit, ...]:
        """What the run asks of tp beyond the model: a tp hint lists only degrees that meet these too."""
        limits = []
        if self.resources.world_size:
            limits.append(TpSplit(self.resources.world_size, f"must divide world_size ({self.resources.world_size})"))
        if self.numerics.sequence_parallel and self.seq_len > 0:
            limits.append(TpSplit(self.seq_len, f"must divide seq_len ({self.seq_len}) under sequence parallelism"))
        return tuple(limits)

    def _validate_batch(self) -> None:
        """A step's shape: sequences the model can hold, split evenly over the data ranks."""
        m, data_ranks = self.model.spec, self.layout.data_parallel_size
        if self.seq_len < 1:
            raise ConfigError("seq_len", self.seq_len, "sequence length must be positive", "set --seq-len to 1 or more")
        longest = longest_sequence(m.max_seq_len, m.rope_scaling)
        if self.seq_len > longest:
            scaled = f", times its dynamic RoPE factor ({m.rope_scaling.factor:g})" if longest != m.max_seq_len else ""
            raise ConfigError("seq_len", self.seq_len, f"exceeds model.max_seq_len ({m.max_seq_len}{scaled})",
                              f"set --seq-len {longest} or less")
        if self.steps < 1:
            raise ConfigError("steps", self.steps, "must be at least 1", "set --steps 1 or more")
        if self.global_batch < 1 or self.global_batch % data_ranks:
            raise ConfigError("global_batch", self.global_batch,
                              f"must be a positive multiple of dp*fsdp = {data_ranks} (each data rank gets an equal slice)",
                              f"set --global-batch to a multiple of {data_ranks}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """Build from nested plain data (a YAML file's contents), sectioned or with the flat keys of
        before (plans/config/flat_keys.py): unknown keys and values of the wrong type are errors
        naming the key (typos must not pass silently)."""
        data, written_as = sectioned(data)
        kwargs = {"model": _model_choice(data.pop("model", None) or {})}
        for name, declared in sections(cls):
            if name in data:  # model, read above, is the one section whose file form is not its fields
                values, kind = data.pop(name), declared.kind
                kwargs[name] = kind(**checked_section(name, {} if values is None else values, kind,
                                                      written_as=written_as.get(name)))
        kwargs.update(checked_section("", data, cls))
        return cls(**kwargs)


def _model_choice(values: dict) -> ModelChoice:
    """The model section: a preset's name plus any of its fields to change."""
    values = checked_section("model", values, ModelConfig, extra_keys=frozenset({"preset"}),
                             internal_keys=frozenset({"user"}))
    name = values.pop("preset", "tiny")
    if not isinstance(name, str):
        raise ConfigError("model.preset", name, "must be a preset's name", f"write one of {', '.join(PRESETS)}")
    return ModelChoice(name, preset(name, **values), vocab_size=values.get("vocab_size"))


def with_overrides(config: TrainConfig, **overrides) -> TrainConfig:
    """Apply dotted overrides such as {"layout.tp": 2, "optimizer.lr": 1e-3, "steps": 5}; None
    leaves a setting as it is (a flag not given)."""
    nested: dict[str, dict] = {}
    flat = {}
    for key, value in overrides.items():
        if value is None:
            continue
        head, _, rest = key.partition(".")
        if rest:
            nested.setdefault(head, {})[rest] = value
        else:
            flat[key] = value
    for head, values in nested.items():
        current = getattr(config, head)
        flat[head] = replace(current, **checked_section(head, values, type(current)))
    return replace(config, **checked_section("", flat, TrainConfig))
