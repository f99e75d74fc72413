"""The step runner of a pipeline: this rank's stages, driven by the plan's interpreter.

Each stage has TP and FSDP2 inside it; FSDP2 accumulates unsharded gradients over every
microbatch and reduces once after the plan (`defer_gradient_reduction` / `reduce_gradients_now`).
Tied embeddings across stages are one logical parameter: after the plan the first stage's
embedding and the last stage's copy each get the sum of both gradients. Every wait of the step
is bounded by the pipeline timeout, so a stalled or dead peer becomes an error naming this rank.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from rayshard.actors.parallel.init_weights import initialize_parameters
from rayshard.actors.training.converters import convert_model
from rayshard.plans.training.converters import run_plan
from rayshard.actors.model.moe import set_aux_loss_scale
from rayshard.actors.parallel.parallelize import defer_gradient_reduction, parallelize, reduce_gradients_now
from rayshard.actors.parallel.precision import compute_dtype
from rayshard.actors.parallel.shards import NO_PIPELINE_COPIES, PipelineCopies
from rayshard.actors.model.lora import adapters_disabled
from rayshard.actors.model.stage import RankStages, build_stage_on_meta, carve_stage, local_tensor, stage_global_names
from rayshard.actors.model.user_model import build_user_on_meta
from rayshard.actors.pipeline.forward_only import forward_only
from rayshard.actors.pipeline.interpreter import PipelineRunner, PipelineStepError, StepRecord, wait_or_fail
from rayshard.actors.training.preference_loss import sequence_logps
from rayshard.actors.training.step_runner import loss_context, microbatch_loss, objective_criterion
from rayshard.plans.config import TrainConfig
from rayshard.plans.layout.parallel_layout import RankCoords
from rayshard.plans.pipeline.plan import PipelinePlan

_TIED_TAG = 2**30  # above every pipeline transfer's tag


def build_rank_stages(config: TrainConfig, plan: PipelinePlan, pp_rank: int, mesh: DeviceMesh,
                      device: torch.device, initialize: bool = True) -> RankStages:
    """Only this rank's pipeline stages, each with TP and FSDP2 inside it; initialize: draw their
    initial weights (False: left unset, for a load that fills every parameter)."""
    model_config, partition, layout, numerics = config.model.spec, plan.partition, config.layout, config.numerics
    last = partition.num_stages - 1
    # Under a zero-bubble schedule the interpreter recomputes whole stages instead (`recomputes_stages`).
    block_ac = "none" if recomputes_stages(config) else config.numerics.ac
    modules, user = {}, model_config.user
    for stage in partition.stages_of_rank(pp_rank):
        layers, first, is_last = partition.stage_layers[stage], stage == 0, stage == last
        if user is not None:
            module = carve_stage(build_user_on_meta(user).module, user.plan, layers, first, is_last)
        else:
            module = build_stage_on_meta(model_config, layers, first, is_last)
        convert_model(module, config)
        parallelize(module, mesh, layout.tp, layout.data_parallel_size, tie_embeddings=model_config.tie_embeddings,
                    pipeline=True, precision=numerics.precision, ac=block_ac, compile_blocks=numerics.compile,
                    sequence_parallel=numerics.sequence_parallel, plan=run_plan(config), ep=layout.ep)
        set_aux_loss_scale(module, model_config, config.pipeline.microbatches)
        module.to_empty(device=device)
        if initialize:
            initialize_parameters(module, config.seed, model_config.n_layers,
                                  stage_global_names(model_config, stage == 0, stage == last),
                                  zero_norms=model_config.norm == "rmsnorm_plus_one")
        modules[stage] = module
    return RankStages(model_config, modules, partition.num_stages)


def stage_sequence_length(config: TrainConfig) -> int:
    """Tokens per sequence in what stages exchange: a tp rank's shard under sequence parallelism."""
    return config.seq_len // config.layout.tp if config.numerics.sequence_parallel else config.seq_len


def recomputes_stages(config: TrainConfig) -> bool:
    """Activation checkpointing under a schedule that splits the backward (I, then W later).

    Per-block checkpointing recomputes a block once per autograd pass that reaches it: I and W
    are two passes (W per weight group, even), so the forward would run again for W. Instead the
    interpreter runs F without keeping activations and rebuilds the stage's graph once, at the
    first of I/B/W; W then reuses the tensors I's pass kept (`actors/pipeline/interpreter.py`).
    """
    return config.numerics.ac != "none" and config.pipeline.splits_backward


class PipelinedRunner:
    def __init__(self, config: TrainConfig, plan: PipelinePlan, stages: RankStages, rank: int,
                 device: torch.device, timeout_s: float, reference: RankStages | None = None):
        self.config, self.plan, self.model = config, plan, stages
        # --objective dpo without LoRA: this rank's stages of a frozen copy of the starting weights,
        # built and sharded as the policy's, no optimizer state (decision 159); with LoRA the
        # policy's own stages with adapters disabled. Run forward-only before the plan (decision 190).
        self.reference = reference
        self.layout = config.layout
        self.rank, self.coords, self.device = rank, self.layout.coords_of(rank), device
        self.timeout_s = timeout_s
        self.collective_timeout = timedelta(seconds=timeout_s)
        self.pipeline_copies = (PipelineCopies((stages.tied_copy,)) if stages.tied_copy is not None
                                else NO_PIPELINE_COPIES)
        microbatch_size = config.global_batch // self.layout.data_parallel_size // config.pipeline.microbatches
        # A user model's own loss (the factory's; it runs where the last stage runs).
        user = config.model.spec.user
        criterion = objective_criterion(config) or (build_user_on_meta(user).loss if user is not None else None)
        self.criterion = criterion
        self._activation_shape = (microbatch_size, stage_sequence_length(config), config.model.spec.dim)
        self.interpreter = PipelineRunner(
            plan.schedule.ranks[self.coords.pp], stages.modules, num_stages=plan.partition.num_stages,
            microbatches=config.pipeline.microbatches, rank=rank, global_rank_of=self._global_rank_of,
            activation_shape=(microbatch_size, stage_sequence_length(config), config.model.spec.dim),
            dtype=compute_dtype(config.numerics.precision),
            device=device,
            loss_fn=partial(microbatch_loss, microbatches=config.pipeline.microbatches, criterion=criterion),
            timeout_s=timeout_s,
            recompute_stages=recomputes_stages(config))

    @classmethod
    def build(cls, config: TrainConfig, plan: PipelinePlan, rank: int, mesh: DeviceMesh, device: torch.device,
              timeout_s: float, initialize: bool = True) -> "PipelinedRunner":
        pp_rank = config.layout.coords_of(rank).pp
        stages = build_rank_stages(config, plan, pp_rank, mesh, device, initialize)
        reference = None
        if config.objective == "dpo" and not config.lora.enabled and not config.dpo.precomputed:
            # Built and seeded exactly as the policy's stages: the seeded initial weights until the
            # driver loads the run's reference checkpoint into it (Trainer.load_reference).
            reference = build_rank_stages(config, plan, pp_rank, mesh, device)
            for module in reference.modules.values():
                module.requires_grad_(False)
                module.eval()
        return cls(config, plan, stages, rank, device, timeout_s, reference)

    def with_plan(self, plan: PipelinePlan) -> "PipelinedRunner":
        """The same stages replaying another plan (one with the same stage cut)."""
        return PipelinedRunner(self.config, plan, self.model, self.rank, self.device, self.timeout_s, self.reference)

    def _global_rank_of(self, pp_rank: int) -> int:
        coords = self.coords
        return self.layout.rank_of(RankCoords(pp=pp_rank, dp=coords.dp, fsdp=coords.fsdp, tp=coords.tp))

    def forward_backward(self, inputs: list[torch.Tensor],
                         targets: list[torch.Tensor]) -> tuple[torch.Tensor, StepRecord]:
        for module in self.model.modules.values():
            defer_gradient_reduction(module)
        with loss_context(self.layout.tp):
            if getattr(self.criterion, "needs_reference", False) and not self.criterion.precomputed:
                for reference_logps in self._reference_logps(inputs, targets):  # last stage only; in microbatch order
                    self.criterion.set_reference(reference_logps)
            loss, record = self.interpreter.run(inputs, targets)
        for module in self.model.modules.values():
            reduce_gradients_now(module)
        self._sum_tied_gradients()
        return loss, record

    def _reference_logps(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> list[torch.Tensor]:
        """--objective dpo: the reference's summed response log-probabilities of each microbatch's
        rows, from a forward-only pass through the stages before the plan (decision 190); the
        last stage's rank gets them, in microbatch order, and the others an empty list."""
        frozen = self.reference if self.reference is not None else self.model
        with contextlib.ExitStack() as stack:
            if self.reference is None:  # LoRA: the base is the policy's own weights with adapters disabled
                for module in frozen.modules.values():
                    stack.enter_context(adapters_disabled(module))
            return forward_only(
                frozen.modules, self.plan.schedule.stage_ranks, self.coords.pp, inputs,
                lambda logits, microbatch: sequence_logps(logits.float(), targets[microbatch]),
                global_rank_of=self._global_rank_of, activation_shape=self._activation_shape,
                dtype=compute_dtype(self.config.numerics.precision), device=self.device, timeout_s=self.timeout_s,
                rank=self.rank)

    def wait(self, work, what: str) -> None:
        wait_or_fail(work, self.timeout_s, f"rank {self.rank}", f"after its pipeline plan, in {what}")

    @contextlib.contextmanager
    def after_forward_backward(self) -> Iterator[None]:
        try:
            yield
        except PipelineStepError:
            raise
        except Exception as error:
            raise PipelineStepError(f"rank {self.rank} failed after its pipeline plan (gradient norm, optimizer "
                                    f"or loss all-reduce): {type(error).__name__}: {error}") from error

    def _sum_tied_gradients(self) -> None:
        """The first stage's embedding and the last stage's copy are one parameter: each gets
        the sum of both gradients (a + b on one side, b + a on the other: bit-identical)."""
        original, copy = self.model.tied_original, self.model.tied_copy
        if original is None and copy is None:
            return
        if not (original if original is not None else copy).requires_grad:
            return  # frozen (a LoRA run's base): no gradient on either stage, the copies stay equal
        for param in (original, copy):
            if param is not None:
                _place_grad_like_param(param)
        if original is not None and copy is not None:  # both stages on this rank (V placement)
            total = local_tensor(original.grad) + local_tensor(copy.grad)
            local_tensor(original.grad).copy_(total)
            local_tensor(copy.grad).copy_(total)
            return
        mine = local_tensor((original if original is not None else copy).grad)
        stage_ranks = self.plan.schedule.stage_ranks
        peer = self._global_rank_of(stage_ranks[-1] if original is not None else stage_ranks[0])
        theirs = torch.empty_like(mine)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine.contiguous(), peer, tag=_TIED_TAG),
                                        dist.P2POp(dist.irecv, theirs, peer, tag=_TIED_TAG)])
        for work in works:
            self.wait(work, f"the tied-embedding gradient exchange with rank {peer}")
        mine.add_(theirs)


def _place_grad_like_param(param: torch.nn.Parameter) -> None:
    """Give the gradient its parameter's placements. DTensor may leave a sharded parameter's
    gradient replicated (the vocab-parallel embedding's is); the two tied copies must hold
    matching local pieces to be summed element by element."""
    grad = param.grad
    if hasattr(grad, "redistribute") and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)
