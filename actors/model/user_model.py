"""A user's own model: a factory `package.module:function` returning single-device code plus its
plan as data (`plans/training/model_plan.py`), built here on the meta device.

The driver calls the factory once to describe the model (shapes and tp split dims go into the
config, and from there into checkpoint metadata); each rank calls it again to build its shard.
The factory's module must therefore be importable on every rank: under Ray a local run's ranks
inherit the driver's sys.path (PYTHONPATH, the working directory), and `ray job submit` ships
`--working-dir` (the runtime_env working_dir) to every worker.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from rayshard.plans.errors import ConfigError
from rayshard.plans.training.model_plan import CROSS_ENTROPY, ModelPlan, UserModel, recorded_parameters, validate_plan
from rayshard.plans.training.model_spec import USER_FAMILY, ModelConfig

Criterion = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class FactoryModel:
    """What a model factory returns: the single-device module (built on whatever device is
    current: the meta device here), its plan, and the criterion (logits, targets) -> mean loss,
    kept apart from the model; None is the built-in cross-entropy, vocab-parallel under tp."""

    module: nn.Module
    plan: ModelPlan
    loss: Criterion | None = None


def import_factory(path: str) -> Callable[[], FactoryModel]:
    module_name, colon, attribute = path.partition(":")
    if not colon or not module_name or not attribute:
        raise ConfigError("model.factory", path, "is not 'package.module:function'",
                          "pass e.g. --model-factory examples.gpt2.model:tiny_gpt2")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError("model.factory", path, f"cannot be imported ({error})",
                          "run from the directory holding the package, or put it on PYTHONPATH "
                          "(ray job submit: --working-dir)") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError("model.factory", path, f"module {module_name} has no function {attribute}",
                          "name a function of that module that returns a FactoryModel")
    return factory


def call_on_meta(path: str) -> FactoryModel:
    """The factory's model with parameters that have no storage: nothing is allocated."""
    with torch.device("meta"):
        made = import_factory(path)()
    if not isinstance(made, FactoryModel):
        raise ConfigError("model.factory", path, f"returned {type(made).__name__}, not a FactoryModel",
                          "return rayshard.actors.model.user_model.FactoryModel(module, plan, loss)")
    return made


def criterion_name(loss: Criterion | None) -> str:
    return CROSS_ENTROPY if loss is None else f"{loss.__module__}:{getattr(loss, '__qualname__', repr(loss))}"


def describe_factory(path: str) -> ModelConfig:
    """The model the factory builds, as the config and checkpoints record it; the plan is checked
    against the module first (every pattern names a module, every parameter has a stage)."""
    made = call_on_meta(path)
    module_names = [name for name, _ in made.module.named_modules() if name]
    shapes = {name: tuple(param.shape) for name, param in made.module.named_parameters()}
    if len(shapes) != len(list(made.module.named_parameters(remove_duplicate=False))):
        raise ConfigError("model.factory", path, "shares a parameter between modules (tied weights)",
                          "untie them: user models do not tie parameters yet")
    plan = replace(made.plan, loss=criterion_name(made.loss))
    validate_plan(plan, module_names, shapes)
    user = UserModel(path, plan, recorded_parameters(plan, shapes))
    return ModelConfig(vocab_size=plan.vocab_size, dim=plan.hidden_size, n_layers=user.n_blocks, n_heads=1,
                       n_kv_heads=1, ffn_dim=1, max_seq_len=plan.max_seq_len, family=USER_FAMILY, user=user).validate()


def build_user_on_meta(user: UserModel) -> FactoryModel:
    """On a rank: the factory's model again, checked against what the driver recorded (a
    factory that changed since the checkpoint was written would load wrong shapes)."""
    made = call_on_meta(user.factory)
    built = {name: tuple(param.shape) for name, param in made.module.named_parameters()}
    if built != user.shapes:
        differing = sorted(set(built.items()) ^ set(user.shapes.items()))[:3]
        raise ConfigError("model.factory", user.factory, f"now builds other parameters than recorded: {differing}",
                          "resume with the factory code the checkpoint was trained with")
    return made
