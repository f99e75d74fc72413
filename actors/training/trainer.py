"""What one rank does: build its shard of the model, train steps, save and load its chunks.

Independent of Ray so the same code runs under `torch.multiprocessing` in the orchestration
benchmark; `actors/rank.py` is the thin Ray actor around it.
"""
from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from actors.checkpoint.load import forget_handover_groups, load_rank_shard

from actors.checkpoint.save import save_rank_shard
from actors.training.data import corpus_fingerprint, load_corpus, rank_batch
from actors.model.init_weights import initialize_parameters
from actors.model.transformer import build_on_meta
from actors.model.parallelize import clip_grad_norm, defer_gradient_reduction, parallelize, reduce_gradients_now
from actors.pipeline.interpreter import PipelineRunner, PipelineStepError, StepRecord, wait_or_fail
from actors.model.shards import is_primary_replica, mark_pipeline_copy
from actors.model.stage import RankStages, build_stage_on_meta, local_tensor, stage_global_names
from plans.config import TrainConfig
from plans.layout.parallel_layout import MESH_DIM_NAMES, RankCoords
from plans.training.lr_schedule import learning_rate
from plans.training.model_spec import parameter_shapes
from plans.pipeline.plan import PipelinePlan, build_pipeline_plan


_TIED_TAG = 2**30  # above every pipeline transfer's tag


def forget_previous_meshes() -> None:
    """Drop DTensor's caches of sharding decisions before a reused process trains again.

    They are keyed by DeviceMesh equality, which compares shapes and ranks but not process
    groups: a new mesh equal to an earlier run's would pick up that run's destroyed groups
    ("Could not resolve the process group registered under the name 19"), or a new group that
    reused the name, and its collectives would hang or talk to the wrong ranks.
    """
    from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    clear_redistribute_planner_cache()
    forget_handover_groups()


def _place_grad_like_param(param: torch.nn.Parameter) -> None:
    """Give the gradient its parameter's placements. DTensor may leave a sharded parameter's
    gradient replicated (the vocab-parallel embedding's is); the two tied copies must hold
    matching local pieces to be summed element by element."""
    grad = param.grad
    if hasattr(grad, "redistribute") and tuple(grad.placements) != tuple(param.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def param_groups_by_mesh(parameters) -> list[dict]:
    """One optimizer param group per device mesh (plain tensors form their own group).

    AdamW's foreach kernels batch a group's tensors together and DTensor refuses to mix plain
    tensors with DTensors, which is exactly what TP-without-FSDP has (replicated norm weights).
    """
    groups: dict[object, list] = {}
    for param in parameters:
        groups.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return [{"params": params} for params in groups.values()]


class Trainer:
    """plan: the pipeline plan the driver built (pp > 1); rebuilt here from the config if None.
    device: "cuda" (this process's current GPU, NCCL) or "cpu" (gloo). The caller decides: a rank
    on a GPU machine that was given no GPU (a CPU share, a CPU benchmark) must not take one."""

    def __init__(self, config: TrainConfig, rank: int, init_method: str, plan: PipelinePlan | None = None,
                 device: str = "cpu"):
        torch.set_num_threads(1)
        self.config = config.validate()
        self.rank = rank
        self.layout = config.layout
        self.coords = self.layout.coords_of(rank)
        self.coord_map = {"dp": self.coords.dp, "fsdp": self.coords.fsdp, "tp": self.coords.tp}
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        forget_previous_meshes()
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=self.layout.world_size,
                                timeout=timedelta(seconds=config.collective_timeout_s))
        self.mesh = init_device_mesh(self.device.type, self.layout.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
        self.pipeline_timeout_s = config.pipeline_timeout_s or config.collective_timeout_s
        self.runner = None
        if self.layout.pp > 1:
            self.plan = plan or build_pipeline_plan(config.model, self.layout, config.schedule, config.microbatches,
                                                    config.stage_layout)
            self.model = self._build_stages()
            self.runner = self._build_runner()
        else:
            self.model = self._build_model()
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(param_groups_by_mesh(self.model.parameters()), lr=opt.lr, betas=(opt.beta1, opt.beta2),
                                           eps=opt.eps, weight_decay=opt.weight_decay, foreach=True)
        self.corpus = load_corpus(config.data.source, config.data.max_bytes)
        self.step = 0  # steps completed: the data position and the lr schedule's state

    def _build_model(self):
        model = build_on_meta(self.config.model)
        parallelize(model, self.mesh, self.layout.tp, self.layout.data_parallel_size,
                    tie_embeddings=self.config.model.tie_embeddings)
        model.to_empty(device=self.device)
        if self.config.model.tie_embeddings and model.output.weight is not model.tok_embeddings.weight:
            # to_empty swaps each module's parameter separately, which unties shared ones.
            model.output.weight = model.tok_embeddings.weight
        initialize_parameters(model, self.config.seed, self.config.model.n_layers)
        return model

    def _build_stages(self) -> RankStages:
        """Only this rank's pipeline stages, each with TP and FSDP2 inside it."""
        model_config, partition = self.config.model, self.plan.partition
        last = partition.num_stages - 1
        modules = {}
        for stage in partition.stages_of_rank(self.coords.pp):
            module = build_stage_on_meta(model_config, partition.stage_layers[stage], stage == 0, stage == last)
            parallelize(module, self.mesh, self.layout.tp, self.layout.data_parallel_size,
                        tie_embeddings=model_config.tie_embeddings, pipeline=True)
            module.to_empty(device=self.device)
            initialize_parameters(module, self.config.seed, model_config.n_layers,
                                  stage_global_names(model_config, stage == 0, stage == last))
            modules[stage] = module
        stages = RankStages(model_config, modules, partition.num_stages)
        if stages.tied_copy is not None:
            mark_pipeline_copy(stages.tied_copy)
        return stages

    def _build_runner(self) -> PipelineRunner:
        config, coords = self.config, self.coords
        microbatch_size = config.global_batch // self.layout.data_parallel_size // config.microbatches

        def global_rank_of(pp_rank: int) -> int:
            return self.layout.rank_of(RankCoords(pp=pp_rank, dp=coords.dp, fsdp=coords.fsdp, tp=coords.tp))

        return PipelineRunner(
            self.plan.schedule.ranks[coords.pp], self.model.modules, num_stages=self.plan.partition.num_stages,
            microbatches=config.microbatches, rank=self.rank, global_rank_of=global_rank_of,
            activation_shape=(microbatch_size, config.seq_len, config.model.dim), dtype=torch.float32,
            device=self.device, loss_fn=self._microbatch_loss, timeout_s=self.pipeline_timeout_s)

    def _microbatch_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Scaled by 1/microbatches: the microbatches' gradients then add up to the batch's."""
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten()) / self.config.microbatches

    # ---- training ---------------------------------------------------------------------------

    def train_step(self) -> dict:
        """One optimizer step on global batch number self.step; returns metrics."""
        config, opt = self.config, self.config.optimizer
        started = time.perf_counter()
        lr = learning_rate(self.step, opt.lr, opt.min_lr, opt.warmup_steps, opt.decay_steps or config.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        total_loss, record = self._forward_backward()
        try:
            grad_norm = clip_grad_norm(self.model.parameters(), opt.grad_clip, self.coord_map,
                                       timeout=self._collective_timeout())
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self._mark_tied_state()
            total_loss = self._mean_loss(total_loss)
        except PipelineStepError:
            raise
        except Exception as error:
            if self.runner is None:
                raise
            raise PipelineStepError(f"rank {self.rank} failed after its pipeline plan (gradient norm, optimizer "
                                    f"or loss all-reduce): {type(error).__name__}: {error}") from error
        self.step += 1
        metrics = {"step": self.step, "loss": total_loss.item(), "grad_norm": float(grad_norm), "lr": lr,
                   "rank_seconds": time.perf_counter() - started}
        if record is not None:
            metrics["pipeline"] = {"plan_seconds": record.plan_seconds, "wait_seconds": record.wait_seconds,
                                   "action_seconds": [[*key, seconds] for key, seconds in record.action_seconds.items()]}
        return metrics

    def _batch(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This data rank's microbatches of global batch number self.step."""
        config = self.config
        inputs, targets = rank_batch(self.corpus, config.seed, self.step, config.global_batch, config.seq_len,
                                     self.layout.data_rank_of(self.rank), self.layout.data_parallel_size)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        return list(inputs.chunk(config.microbatches)), list(targets.chunk(config.microbatches))

    def _forward_backward(self) -> tuple[torch.Tensor, StepRecord | None]:
        """Gradients of this step's batch, reduced over data ranks (and the tied embedding
        summed over its two stages); returns this rank's share of the loss."""
        inputs, targets = self._batch()
        if self.runner is None:
            return self._accumulate_gradients(inputs, targets), None
        if self.config.stall_rank == self.rank:
            time.sleep(self.config.stall_seconds)
        if self.config.exit_rank == self.rank:
            os._exit(1)
        for module in self.model.modules.values():
            defer_gradient_reduction(module)
        with loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext():
            loss, record = self.runner.run(inputs, targets)
        for module in self.model.modules.values():
            reduce_gradients_now(module)
        self._sum_tied_gradients()
        return loss, record

    def _accumulate_gradients(self, inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
        """Without a pipeline: plain gradient accumulation over the microbatches."""
        sharded = hasattr(self.model, "set_requires_gradient_sync")
        total_loss = torch.zeros((), device=self.device)
        for index, (x, y) in enumerate(zip(inputs, targets)):
            if sharded:  # reduce gradients once per step, on the last microbatch
                self.model.set_requires_gradient_sync(index == len(inputs) - 1)
            logits = self.model(x)
            with loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext():
                loss = self._microbatch_loss(logits, y)
                loss.backward()
            total_loss += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        return total_loss

    def _mean_loss(self, total_loss: torch.Tensor) -> torch.Tensor:
        """Every rank reports the same number: the mean over data ranks. tp peers hold equal
        copies, and only the ranks running the last pipeline stage hold any."""
        self._wait(dist.all_reduce(total_loss, async_op=True), "the loss all-reduce")
        return total_loss / (self.layout.world_size // self.layout.pp)

    def _collective_timeout(self) -> timedelta | None:
        return timedelta(seconds=self.pipeline_timeout_s) if self.runner is not None else None

    def _wait(self, work, what: str) -> None:
        if self.runner is None:
            work.wait()
        else:
            wait_or_fail(work, self.pipeline_timeout_s, f"rank {self.rank}", f"after its pipeline plan, in {what}")

    # ---- tied embeddings across pipeline stages -----------------------------------------------

    def _sum_tied_gradients(self) -> None:
        """The first stage's embedding and the last stage's copy are one parameter: each gets
        the sum of both gradients (a + b on one side, b + a on the other: bit-identical)."""
        original, copy = self.model.tied_original, self.model.tied_copy
        if original is None and copy is None:
            return
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
        peer_pp = stage_ranks[-1] if original is not None else stage_ranks[0]
        peer = self.layout.rank_of(RankCoords(pp=peer_pp, dp=self.coords.dp, fsdp=self.coords.fsdp, tp=self.coords.tp))
        theirs = torch.empty_like(mine)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine.contiguous(), peer, tag=_TIED_TAG),
                                        dist.P2POp(dist.irecv, theirs, peer, tag=_TIED_TAG)])
        for work in works:
            self._wait(work, f"the tied-embedding gradient exchange with rank {peer}")
        mine.add_(theirs)

    def _mark_tied_state(self) -> None:
        """The copy's AdamW moments are copies too: checkpoints write the first stage's."""
        copy = self.model.tied_copy if self.runner is not None else None
        if copy is not None:
            for value in self.optimizer.state.get(copy, {}).values():
                if isinstance(value, torch.Tensor):
                    mark_pipeline_copy(value)

    # ---- test support -----------------------------------------------------------------------

    def full_gradients(self) -> dict:
        """The loss and every parameter's full gradient for this step's batch, before clipping;
        no optimizer step. Each rank returns the parameters it is the primary holder of, under
        their global names (tests compare layouts with this; keep models tiny)."""
        total_loss, _ = self._forward_backward()
        gradients = {}
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            full = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            if is_primary_replica(param, self.coord_map) and not any(self.coord_map.values()):
                gradients[name] = full.detach().cpu().clone()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": self._mean_loss(total_loss).item(), "gradients": gradients}

    # ---- checkpoints ------------------------------------------------------------------------

    def save_shard(self, checkpoint_url: str, file: str) -> list[dict]:
        return save_rank_shard(self.model, self.optimizer, self.coord_map, checkpoint_url, file)

    def load(self, checkpoint_url: str, manifest: bytes | None = None) -> dict:
        result = load_rank_shard(self.model, self.optimizer, checkpoint_url, set(parameter_shapes(self.config.model)),
                                 manifest)
        self._mark_tied_state()
        self.step = result["step"]
        return {"step": result["step"], "bytes_read": result["bytes_read"], "seconds": result["seconds"],
                "partial_reads": result["partial_reads"]}

    def data_fingerprint(self) -> str:
        return corpus_fingerprint(self.corpus)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_previous_meshes()
