"""The one typed training configuration, and every constraint it must meet.

Built from plain data (a YAML file's contents plus CLI overrides); validation errors name the
field, the constraint and a fix. Pure: reading the file is the CLI's job.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace

from rayshard.plans.config_values import checked_section
from rayshard.plans.errors import ConfigError
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_plan import check_tp_divides
from rayshard.plans.training.model_spec import PRESETS, ModelConfig, check_experts_fit, preset
from rayshard.plans.pipeline.csv_order import pipeline_order
from rayshard.plans.pipeline.plan import stage_partition
from rayshard.plans.pipeline.schedules import build_schedule, schedule_spec, valid_microbatch_counts

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
PRECISIONS = ("fp32", "bf16")
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 10
    decay_steps: int | None = None  # cosine length; defaults to the run's total steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    source: str = "stdlib"  # "stdlib", a file, a directory, a glob, or an fsspec URL (or a prepared dataset's)
    max_bytes: int = 8_000_000
    # A prepared dataset's URL (`rayshard data prepare --out`); training then reads its tokens.
    dataset: str | None = None
    # Batches of later steps each rank reads ahead in a background thread, and how long one may take.
    prefetch_steps: int = 4
    read_timeout_s: float = 600.0


@dataclass(frozen=True)
class TrainConfig:
    model_preset: str = "tiny"
    model: ModelConfig = field(default_factory=lambda: PRESETS["tiny"])
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    world_size: int | None = None  # optional cross-check of dp*fsdp*tp*pp
    steps: int = 20
    global_batch: int = 8
    seq_len: int = 64
    microbatches: int = 1
    schedule: str = "1f1b"
    seed: int = 1234
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    store: str = "./runs"
    run: str = "demo"
    ckpt_every: int = 0  # 0: only at the end
    resume: str | None = None  # "latest", "RUN@STEP", "RUN" or a checkpoint URL
    collective_timeout_s: float = 300.0
    # After a resume, save the loaded state to a side copy and check its per-tensor digests equal
    # the checkpoint's before training on (one extra save and two digests per resume).
    verify_resume: bool = False
    # Pipeline (pp > 1). stage_layout: layer counts per stage (pp * vpp of them) for an uneven
    # cut, e.g. [1, 3]; None cuts evenly. pipeline_timeout_s: how long one transfer (or the
    # step's own all-reduce) may wait before the step fails naming rank, step and action;
    # None means collective_timeout_s.
    stage_layout: tuple[int, ...] | None = None
    pipeline_timeout_s: float | None = None
    # A pipeline order from a file in torch.distributed.pipelining's CSV format (its cells, one
    # tuple per rank; `plans/pipeline/csv_order.py`), run instead of a named schedule.
    schedule_csv: tuple[tuple[str, ...], ...] | None = None
    # Resources per rank (None: an equal share of the cluster's CPUs, at most one; one GPU where
    # the cluster has GPUs). start_timeout_s bounds each start-up wait (placement group granted,
    # actors alive); call_timeout_s bounds any one call on the ranks (a step, a load, a save), a
    # backstop behind the ranks' own collective and storage timeouts (docs/decisions.md).
    cpus_per_rank: float | None = None
    gpus_per_rank: float | None = None
    start_timeout_s: float = 60.0
    call_timeout_s: float = 3600.0
    # Numerics and speed (docs/decisions.md, "Training at real precision"). precision "bf16":
    # bf16 compute, float32 master weights, moments and gradient reduction; checkpoints always
    # hold the float32 state. ac: activation checkpointing per transformer block ("selective"
    # keeps matmul outputs and recomputes the rest). compile: torch.compile per block.
    precision: str = "fp32"
    ac: str = "none"
    compile: bool = False
    # Sequence parallelism with TP: norms and the residual stream split over the sequence.
    sequence_parallel: bool = False
    # Where step metrics go besides metrics.jsonl and the console: TensorBoard event files under
    # the run directory; Weights & Biases (needs the wandb package) under this project name.
    tensorboard: bool = False
    wandb_project: str | None = None

    def __post_init__(self):
        if self.stage_layout is not None and not isinstance(self.stage_layout, tuple):
            object.__setattr__(self, "stage_layout", tuple(self.stage_layout))  # YAML gives a list
        if self.schedule_csv is not None and not isinstance(self.schedule_csv, tuple):
            object.__setattr__(self, "schedule_csv", tuple(tuple(row) for row in self.schedule_csv))

    def validate(self) -> "TrainConfig":
        self.model.validate()
        m, lay = self.model, self.layout
        if self.world_size is not None and self.world_size != lay.world_size:
            raise ConfigError("world_size", self.world_size,
                              f"must equal dp*fsdp*tp*pp = {lay.dp}*{lay.fsdp}*{lay.tp}*{lay.pp} = {lay.world_size}",
                              "change --world-size or the parallel degrees so they agree")
        if m.user is not None:
            check_tp_divides(m.user, lay.tp)
        elif m.n_kv_heads % lay.tp:
            raise ConfigError("layout.tp", lay.tp, f"must divide the number of kv heads ({m.n_kv_heads})",
                              f"use --tp in {_divisors(m.n_kv_heads)}")
        if m.user is None and m.ffn_dim % lay.tp:
            raise ConfigError("layout.tp", lay.tp, f"must divide model.ffn_dim ({m.ffn_dim})",
                              f"use --tp in {_divisors(m.ffn_dim)}")
        if m.user is None and m.vocab_size % lay.tp:
            raise ConfigError("layout.tp", lay.tp, f"must divide model.vocab_size ({m.vocab_size}) for the vocab-parallel embedding",
                              f"use --tp in {_divisors(m.vocab_size)}")
        if lay.pp * lay.vpp > m.n_layers:
            raise ConfigError("layout.pp", lay.pp, f"pp*vpp = {lay.pp * lay.vpp} stages exceed the model's {m.n_layers} layers",
                              "lower --pp/--vpp or use a deeper model")
        check_experts_fit(m, lay)
        if m.is_moe and self.sequence_parallel:
            raise ConfigError("sequence_parallel", True, "is not supported with mixture-of-experts layers yet",
                              "drop --sp for MoE models")
        if self.seq_len < 1:
            raise ConfigError("seq_len", self.seq_len, "sequence length must be positive", "set --seq-len to 1 or more")
        if self.seq_len > m.max_seq_len:
            raise ConfigError("seq_len", self.seq_len, f"exceeds model.max_seq_len ({m.max_seq_len})",
                              f"set --seq-len {m.max_seq_len} or less")
        if self.steps < 1:
            raise ConfigError("steps", self.steps, "must be at least 1", "set --steps 1 or more")
        if self.global_batch < 1 or self.global_batch % lay.data_parallel_size:
            raise ConfigError("global_batch", self.global_batch,
                              f"must be a positive multiple of dp*fsdp = {lay.data_parallel_size} (each data rank gets an equal slice)",
                              f"set --global-batch to a multiple of {lay.data_parallel_size}")
        per_rank = self.global_batch // lay.data_parallel_size
        if self.microbatches < 1 or per_rank % self.microbatches:
            raise ConfigError("microbatches", self.microbatches,
                              f"must divide the per-rank batch ({per_rank} = global_batch / (dp*fsdp))",
                              self._microbatch_fix(per_rank))
        self._validate_pipeline()
        if self.ckpt_every < 0:
            raise ConfigError("ckpt_every", self.ckpt_every, "must be >= 0 (0 saves only at the end)", "set --ckpt-every 0 or more")
        if not RUN_NAME.match(self.run):
            raise ConfigError("run", self.run, "run names are 1-128 letters, digits, '.', '_' or '-' and start with a letter or digit",
                              "pick a name like my-run-01")
        opt = self.optimizer
        if opt.lr <= 0 or opt.min_lr < 0 or opt.min_lr > opt.lr:
            raise ConfigError("optimizer.lr", opt.lr, "need lr > 0 and 0 <= min_lr <= lr", "adjust --lr / optimizer.min_lr")
        if opt.warmup_steps < 0:
            raise ConfigError("optimizer.warmup_steps", opt.warmup_steps, "must be >= 0", "set it to 0 or more")
        if self.data.max_bytes < self.seq_len + 2:
            raise ConfigError("data.max_bytes", self.data.max_bytes, "the corpus must hold at least one sequence",
                              f"set data.max_bytes above {self.seq_len + 1}")
        if self.data.prefetch_steps < 0:
            raise ConfigError("data.prefetch_steps", self.data.prefetch_steps, "must be >= 0 (0 reads each batch when needed)",
                              "set data.prefetch_steps to 0 or more")
        if self.data.read_timeout_s <= 0:
            raise ConfigError("data.read_timeout_s", self.data.read_timeout_s, "must be positive", "set it to e.g. 600")
        if self.collective_timeout_s <= 0:
            raise ConfigError("collective_timeout_s", self.collective_timeout_s, "must be positive", "set it to e.g. 300")
        if self.pipeline_timeout_s is not None and self.pipeline_timeout_s <= 0:
            raise ConfigError("pipeline_timeout_s", self.pipeline_timeout_s, "must be positive (or unset for collective_timeout_s)",
                              "set it to e.g. 300")
        for name in ("cpus_per_rank", "gpus_per_rank"):
            value = getattr(self, name)
            if value is not None and (value < 0 or (value > 0 and value < 1e-4)):
                raise ConfigError(name, value, "must be 0 or at least 0.0001 (Ray's resource grain)",
                                  f"pass --{name.replace('_', '-')} 0.5, or leave it unset for the default")
        if self.cpus_per_rank == 0 and not self.gpus_per_rank:
            raise ConfigError("cpus_per_rank", 0, "a CPU rank needs some CPU", "leave --cpus-per-rank unset, or pass e.g. 0.5")
        if self.precision not in PRECISIONS:
            raise ConfigError("precision", self.precision, f"must be one of {list(PRECISIONS)}", "pass --precision fp32 or bf16")
        if self.sequence_parallel and m.user is not None and not m.user.plan.sequence_parallel:
            raise ConfigError("sequence_parallel", True, f"the plan of {m.user.factory} declares no sequence parallelism",
                              "add its norms and sequence gathers to the plan's sequence_parallel, or drop --sp")
        if self.sequence_parallel and lay.tp == 1:
            raise ConfigError("sequence_parallel", True, "splits the sequence over the tp ranks, and tp is 1",
                              "add --tp 2 (or more), or drop --sp")
        if self.sequence_parallel and self.seq_len % lay.tp:
            raise ConfigError("seq_len", self.seq_len, f"must be a multiple of tp ({lay.tp}) under sequence parallelism",
                              f"set --seq-len to a multiple of {lay.tp}")
        if self.ac not in ACTIVATION_CHECKPOINTING:
            raise ConfigError("ac", self.ac, f"must be one of {list(ACTIVATION_CHECKPOINTING)}",
                              "pass --ac none, full or selective")
        for name in ("start_timeout_s", "call_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, getattr(self, name), "must be positive", "set it to e.g. 60")
        return self

    @property
    def splits_backward(self) -> bool:
        """The pipeline order runs each stage's backward as I and W (zero-bubble schedules)."""
        if self.schedule_csv:
            return pipeline_order(self.schedule_csv).splits_backward
        return schedule_spec(self.schedule).splits_backward

    def _validate_pipeline(self) -> None:
        """Schedule name, stages per rank, microbatch count and stage cut, checked up front."""
        if self.schedule_csv:
            self._validate_pipeline_order()
            return
        lay = self.layout
        spec = schedule_spec(self.schedule)  # a typo fails even when pp == 1
        if lay.pp == 1:
            if self.stage_layout is not None:
                raise ConfigError("stage_layout", self.stage_layout, "only applies to pipelines (pp > 1)",
                                  "drop stage_layout, or set --pp 2 or more")
            return
        if spec.fixed_vpp and lay.vpp != spec.default_vpp:
            raise ConfigError("layout.vpp", lay.vpp, f"the {spec.title} schedule runs exactly {spec.default_vpp} stage(s) per rank",
                              f"use --vpp {spec.default_vpp}, or interleaved1f1b for other vpp")
        if self.compile and spec.splits_backward:
            raise ConfigError("compile", True, f"the {spec.title} schedule splits each stage's backward into input and "
                              "weight halves, which cannot see inside a compiled block's backward",
                              "drop --compile, or use --schedule 1f1b, gpipe or interleaved1f1b")
        if not spec.accepts(lay.pp, lay.vpp, self.microbatches):
            raise ConfigError("microbatches", self.microbatches,
                              f"{spec.title} on pp={lay.pp}" + (f" with vpp={lay.vpp}" if lay.vpp > 1 else "")
                              + f" needs {spec.counts_rule.format(two_pp=2 * lay.pp)}",
                              self._microbatch_fix(self.global_batch // lay.data_parallel_size))
        build_schedule(spec.name, lay.pp, self.microbatches, lay.vpp)
        try:
            stage_partition(self.model, lay, spec.name, self.stage_layout)
        except ConfigError as error:
            if error.field != "layout":
                raise
            raise ConfigError("stage_layout", self.stage_layout, error.constraint, error.fix) from None

    def _microbatch_fix(self, per_rank: int) -> str:
        """The microbatch counts that both divide the per-rank batch and suit the pipeline
        schedule, or, where none does, the smallest global batch with one: so that following one
        error's fix never runs into the other's."""
        lay = self.layout
        spec = schedule_spec(self.schedule) if lay.pp > 1 and not self.schedule_csv else None
        if spec is None or (spec.fixed_vpp and lay.vpp != spec.default_vpp):  # the vpp error comes first
            return f"use --microbatches in {_divisors(per_rank)}"
        fitting = [m for m in valid_microbatch_counts(spec.name, lay.pp, lay.vpp, up_to=per_rank) if per_rank % m == 0]
        if fitting:
            return f"use --microbatches in {fitting}"
        served = valid_microbatch_counts(spec.name, lay.pp, lay.vpp, up_to=64 * lay.pp * lay.vpp)
        if not served:
            return f"use another --schedule: {spec.title} serves no microbatch count on pp={lay.pp}"
        smallest = served[0]
        return (f"no count divides the per-rank batch ({per_rank}) and suits {spec.title} on pp={lay.pp}: raise "
                f"--global-batch to a multiple of {smallest * lay.data_parallel_size} and use --microbatches {smallest}")

    def _validate_pipeline_order(self) -> None:
        """A pipeline order from a file: its ranks, stages and microbatches must be the run's."""
        lay, order = self.layout, pipeline_order(self.schedule_csv)
        if lay.pp == 1:
            raise ConfigError("layout.pp", 1, "a schedule file orders pipeline stages, and pp is 1",
                              f"set --pp {order.pp} (the file's rows), or drop --schedule-csv")
        for name, ours, theirs in (("layout.pp", lay.pp, order.pp), ("layout.vpp", lay.vpp, order.vpp),
                                   ("microbatches", self.microbatches, order.microbatches)):
            if ours != theirs:
                raise ConfigError(name, ours, f"the schedule file has {theirs}", f"set {name} to {theirs}, or edit the file")
        if self.compile and order.splits_backward:
            raise ConfigError("compile", True, "the schedule file splits backwards into I and W, which cannot see "
                              "inside a compiled block's backward", "drop --compile, or write B instead of I/W")
        order.placement  # raises, naming the placement, when layers cannot be cut for it
        stage_partition(self.model, lay, "1f1b", self.stage_layout, self.schedule_csv)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """Build from nested plain data (a YAML file's contents): unknown keys and values of the
        wrong type are errors naming the key (typos must not pass silently)."""
        data = dict(data)
        model_data = data.pop("model", None) or {}
        if isinstance(model_data, str):  # `model: small`, a preset's name alone
            model_data = {"preset": model_data}
        model_data = checked_section("model", model_data, ModelConfig, extra_keys=frozenset({"preset"}),
                                     internal_keys=frozenset({"user"}))
        preset_name = model_data.pop("preset", data.pop("model_preset", "tiny"))
        if not isinstance(preset_name, str):
            raise ConfigError("model.preset", preset_name, "must be a preset's name",
                              f"write one of {', '.join(PRESETS)}")
        kwargs = {"model_preset": preset_name, "model": preset(preset_name, **model_data)}
        for name, kind in (("layout", ParallelLayout), ("optimizer", OptimizerConfig), ("data", DataConfig)):
            if name in data:
                kwargs[name] = kind(**checked_section(name, data.pop(name) or {}, kind))
        kwargs.update(checked_section("", data, cls))
        return cls(**kwargs)


def with_overrides(config: TrainConfig, **overrides) -> TrainConfig:
    """Apply dotted overrides such as {"layout.tp": 2, "optimizer.lr": 1e-3, "steps": 5}."""
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
        section = getattr(config, head)
        flat[head] = replace(section, **checked_section(head, values, type(section)))
    return replace(config, **checked_section("", flat, TrainConfig))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
