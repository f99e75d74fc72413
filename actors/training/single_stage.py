"""The step runner without a pipeline: the whole model on this rank, gradients accumulated over
the microbatches and reduced over data ranks once, on the last one."""
from __future__ import annotations

import contextlib
from typing import ContextManager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from rayshard.actors.parallel.init_weights import initialize_parameters
from rayshard.actors.model.moe import set_aux_loss_scale
from rayshard.actors.parallel.parallelize import parallelize
from rayshard.actors.parallel.shards import NO_PIPELINE_COPIES
from rayshard.actors.training.converters import convert_model
from rayshard.plans.training.converters import run_plan
from rayshard.actors.model.transformer import build_on_meta
from rayshard.actors.model.user_model import Criterion, build_user_on_meta
from rayshard.actors.model.lora import adapters_disabled
from rayshard.actors.training.preference_loss import sequence_logps
from rayshard.actors.training.step_runner import loss_context, microbatch_loss, objective_criterion
from rayshard.plans.config import TrainConfig


class SingleStageRunner:
    pipeline_copies = NO_PIPELINE_COPIES
    collective_timeout = None

    def __init__(self, model: nn.Module, tp: int, microbatches: int, device: torch.device,
                 criterion: Criterion | None = None, reference: nn.Module | None = None):
        self.model = model
        self.tp, self.microbatches, self.device = tp, microbatches, device
        self.criterion = criterion  # a user model's own loss; None: cross-entropy
        # --objective dpo without LoRA: a frozen copy of the starting weights, sharded as the model,
        # with no optimizer state (decision 159); with LoRA the model itself, adapters disabled.
        self.reference = reference

    @classmethod
    def build(cls, config: TrainConfig, mesh: DeviceMesh, device: torch.device,
              initialize: bool = True) -> "SingleStageRunner":
        """The whole model, with TP, AC, compile and FSDP2 applied from outside, then materialized
        and initialized (initialize=False: its weights left unset, for a load that fills them all)."""
        model, made = cls._build_model(config, mesh, device, initialize)
        reference = None
        if config.objective == "dpo" and not config.lora.enabled and not config.dpo.precomputed:
            # Built and seeded exactly as the policy: it holds the seeded initial weights until the
            # driver loads the run's reference checkpoint into it (Trainer.load_reference).
            reference, _ = cls._build_model(config, mesh, device)
            reference.requires_grad_(False)
            reference.eval()
        criterion = objective_criterion(config) or (made.loss if made is not None else None)
        return cls(model, config.layout.tp, config.pipeline.microbatches, device, criterion, reference)

    @staticmethod
    def _build_model(config: TrainConfig, mesh: DeviceMesh, device: torch.device, initialize: bool = True):
        layout, spec, numerics = config.layout, config.model.spec, config.numerics
        made = build_user_on_meta(spec.user) if spec.user is not None else None
        model = convert_model(made.module if made is not None else build_on_meta(spec), config)
        parallelize(model, mesh, layout.tp, layout.data_parallel_size, tie_embeddings=spec.tie_embeddings,
                    precision=numerics.precision, ac=numerics.ac, compile_blocks=numerics.compile,
                    sequence_parallel=numerics.sequence_parallel, plan=run_plan(config), ep=layout.ep)
        set_aux_loss_scale(model, spec, config.pipeline.microbatches)
        model.to_empty(device=device)
        if spec.tie_embeddings and model.output.weight is not model.tok_embeddings.weight:
            # to_empty swaps each module's parameter separately, which unties shared ones.
            model.output.weight = model.tok_embeddings.weight
        if initialize:
            initialize_parameters(model, config.seed, spec.n_layers, zero_norms=spec.norm == "rmsnorm_plus_one")
        return model, made

    @torch.no_grad()
    def reference_logps(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """--objective dpo: the reference's summed response log-probabilities of each row."""
        if self.reference is not None:
            logits = self.reference(x)
        else:
            with adapters_disabled(self.model):
                logits = self.model(x)
        with loss_context(self.tp):
            return sequence_logps(logits.float(), y)

    def forward_backward(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> tuple[torch.Tensor, None]:
        sharded = hasattr(self.model, "set_requires_gradient_sync")
        total_loss = torch.zeros((), device=self.device)
        for index, (x, y) in enumerate(zip(inputs, targets)):
            if sharded:  # reduce gradients once per step, on the last microbatch
                self.model.set_requires_gradient_sync(index == len(inputs) - 1)
            if getattr(self.criterion, "needs_reference", False) and not self.criterion.precomputed:
                self.criterion.set_reference(self.reference_logps(x, y))
            logits = self.model(x)
            with loss_context(self.tp):
                loss = microbatch_loss(logits, y, self.microbatches, self.criterion)
                loss.backward()
            total_loss += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        return total_loss, None

    def wait(self, work, what: str) -> None:
        work.wait()

    def after_forward_backward(self) -> ContextManager[None]:
        return contextlib.nullcontext()
