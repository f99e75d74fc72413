"""The run's model converters, plan side: how they change the parameters' roles and the tp plan.

A converter (LoRA first) changes a built model before it is parallelized (its rank side:
`actors/training/converters.py`); here is what planners need of it without building anything: the
roles of the parameters it adds and freezes (`plans/training/parameter_roles.py`) and the tp
styles of its parameters. A new converter is a file beside `lora.py` plus its lines here.
"""
from __future__ import annotations

from dataclasses import replace

from rayshard.plans.training.lora import lora_roles, lora_tp_styles, user_adapter_tp_styles
from rayshard.plans.training.model_plan import ModelPlan
from rayshard.plans.training.model_spec import ModelConfig
from rayshard.plans.training.parameter_roles import ParameterRoles, full_training


def parameter_roles(model: ModelConfig, lora=None) -> ParameterRoles:
    """The roles of a run's parameters: the model's, as each enabled converter changes them.
    lora: the run's LoraConfig (`plans/config/lora.py`), or None."""
    roles = full_training(model)
    if lora is not None and lora.enabled:
        roles = lora_roles(model, lora, roles)
    return roles


def run_roles(config) -> ParameterRoles:
    """A TrainConfig's parameter roles."""
    return parameter_roles(config.model.spec, config.lora)


def run_plan(config) -> ModelPlan:
    """The model's parallelize plan with the tp styles of the run's converters' parameters."""
    model = config.model.spec
    plan = model.plan
    if config.lora.enabled:
        styles = (user_adapter_tp_styles(model, config.lora.target_list) if model.user is not None
                  else lora_tp_styles(config.lora))
        plan = replace(plan, tp_styles=plan.tp_styles + styles)
    return plan
