"""The training configuration: the job (train_config.py) and one module per section.

    run, store, steps, global_batch, seq_len, seed   the job itself (top level)
    model       model.py        a preset (or factory) and the shape it gives
    layout      plans/layout/parallel_layout.py      dp, fsdp, tp, pp, vpp, ep
    pipeline    pipeline.py     microbatches, schedule, stage cut, transfer timeout
    numerics    numerics.py     precision, activation checkpointing, compile, sequence parallelism
    data        data.py         the corpus or prepared dataset, and reads ahead
    optimizer   optimizer.py    AdamW and the learning-rate schedule
    checkpoint  checkpoint.py   save interval, async saves, resume and its check
    resources   resources.py    ranks, CPUs/GPUs per rank, start/call/collective timeouts
    metrics     metrics.py      TensorBoard, Weights & Biases
    lora        lora.py         low-rank adapters on a frozen base (plans/training/lora.py)
    dpo         dpo.py          --objective dpo's beta, loss and label smoothing

Each field declares its flag, or that it has none (plans/options.py); values.py checks a file's
values against the fields' types; flat_keys.py reads the flat keys of before the sections.
"""
from rayshard.plans.config.checkpoint import CheckpointConfig
from rayshard.plans.config.data import DataConfig
from rayshard.plans.config.dpo import DpoConfig
from rayshard.plans.config.lora import LoraConfig
from rayshard.plans.config.metrics import MetricsConfig
from rayshard.plans.config.model import ModelChoice
from rayshard.plans.config.numerics import ACTIVATION_CHECKPOINTING, PRECISIONS, NumericsConfig
from rayshard.plans.config.optimizer import OptimizerConfig
from rayshard.plans.config.pipeline import PipelineConfig
from rayshard.plans.config.resources import ResourcesConfig
from rayshard.plans.config.train_config import RUN_NAME, TrainConfig, with_overrides

__all__ = ["TrainConfig", "with_overrides", "RUN_NAME", "ModelChoice", "PipelineConfig", "NumericsConfig",
           "PRECISIONS", "ACTIVATION_CHECKPOINTING", "DataConfig", "OptimizerConfig", "CheckpointConfig",
           "ResourcesConfig", "MetricsConfig", "LoraConfig", "DpoConfig"]
