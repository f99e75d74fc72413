"""What one rank does: build its shard of the model, train steps, save and load its chunks.

Independent of Ray so the same code runs under `torch.multiprocessing` in the orchestration
benchmark; `actors/rank.py` is the thin Ray actor around it.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from rayshard.actors.parallel.group_sockets import recording_group_sockets
from rayshard.actors.parallel.mesh_caches import forget_previous_meshes
from rayshard.actors.checkpoint.async_save import AsyncSaver
from rayshard.actors.checkpoint.cast_view import FloatView
from rayshard.actors.checkpoint.load import HandoverGroups, load_rank_shard
from rayshard.actors.checkpoint.save import save_rank_shard
from rayshard.actors.parallel.gradient_norm import clip_grad_norm
from rayshard.actors.parallel.local_shard_adamw import LocalShardAdamW
from rayshard.actors.model.moe import moe_layers
from rayshard.actors.parallel.parallelize import (expert_parameters, reduce_expert_gradients, sum_partial_gradients,
                                      tp_partial_parameters)
from rayshard.actors.parallel.shards import is_primary_replica
from rayshard.actors.pipeline.interpreter import StepRecord
from rayshard.actors.training.data import row_hashes
from rayshard.actors.training.dataset_source import open_training_data
from rayshard.actors.training.device_memory import device_name, peak_memory_bytes, reset_peak_memory
from rayshard.actors.training.host_allocator import keep_freed_host_memory
from rayshard.actors.training.pipelined import PipelinedRunner
from rayshard.actors.training.completion_loss import IGNORE
from rayshard.actors.training.dataset_reader import PreparedDataset
from rayshard.actors.training.preference_loss import REWARD_METRICS, sequence_logps
from rayshard.actors.training.reports import StepMetrics
from rayshard.actors.training.single_stage import SingleStageRunner
from rayshard.actors.training.step_runner import StepRunner, loss_context
from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.config import TrainConfig
from rayshard.plans.layout.parallel_layout import MESH_DIM_NAMES
from rayshard.plans.training.lr_schedule import learning_rate
from rayshard.plans.training.converters import run_roles
from rayshard.plans.pipeline.plan import PipelinePlan, build_pipeline_plan

# Given the rank's step runner and the rank, returns the runner the trainer drives: a generic hook
# (`actors/rank.py` takes one by name), through which tests install faults from outside.
WrapRunner = Callable[[StepRunner, int], StepRunner]


def forget_previous_compiles() -> None:
    """Return torch.compile to a fresh process's state before a reused process trains again.

    Dynamo keeps its compiled graphs and each function's history of input sizes per code object,
    not per model, and every run's blocks share `TransformerBlock.forward`. A run after one with
    other sizes (moe-tiny at seq_len 8, then tiny at 32) found those sizes in that history and
    compiled its very first block with them symbolic ("automatic dynamic"); under TP with full AC,
    AOTAutograd's trace of a symbolic-shape DTensor block then exceeded Python's recursion limit
    (docs/decisions.md 104). Its graphs also sat next to the earlier run's, whose guards hold that
    run's dead blocks. Inductor's on-disk cache is untouched (keyed by graph, so still valid).
    """
    torch._dynamo.reset()


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
    on a GPU machine that was given no GPU (a CPU share, a CPU benchmark) must not take one.
    wrap_runner: applied once to the step runner (`SingleStageRunner` for pp == 1, else
    `PipelinedRunner`); the trainer drives whatever it returns. initialize: draw the initial
    weights (False: every parameter is left unset for a load that fills them all, a resume)."""

    def __init__(self, config: TrainConfig, rank: int, init_method: str, plan: PipelinePlan | None = None,
                 device: str = "cpu", wrap_runner: WrapRunner | None = None, initialize: bool = True):
        torch.set_num_threads(1)
        self.config = config.validate()
        self.rank = rank
        self.layout = config.layout
        self.coords = self.layout.coords_of(rank)
        self.coord_map = {"dp": self.coords.dp, "fsdp": self.coords.fsdp, "tp": self.coords.tp}
        self.device = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cpu":
            keep_freed_host_memory()  # a step's activations live in host memory: reuse, not refault, them
        forget_previous_meshes()
        forget_previous_compiles()
        with recording_group_sockets():  # a rank that leaves after a failure shuts the leftovers (decision 232)
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=self.layout.world_size,
                                    timeout=timedelta(seconds=config.resources.collective_timeout_s))
            self.mesh = init_device_mesh(self.device.type, self.layout.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
        # Kept for this process group's lifetime: hand-over groups across loads, host buffers across saves.
        self.handover_groups, self.async_saver = HandoverGroups(), AsyncSaver()
        # Which parameters train and which the run's checkpoints store (plans/training/parameter_roles.py).
        self.roles = run_roles(config)
        self.runner: StepRunner = self._build_runner(plan, initialize)
        if wrap_runner is not None:
            self.runner = wrap_runner(self.runner, rank)
        # Weights tp keeps whole whose gradients each tp rank holds only its heads' share of.
        self.tp_partial = (tp_partial_parameters(self.model, config.model.spec.plan.tp_partial_gradients)
                           if self.layout.tp > 1 else [])
        # Under ep the experts are outside FSDP: the trainer averages their gradients over data ranks.
        self.experts = expert_parameters(self.model) if self.layout.ep > 1 else []
        self.routers = [(int(name.split(".")[1]), layer) for stage in self._modules() for name, layer in moe_layers(stage)]
        opt = config.optimizer
        # Fused: one kernel per param group and step (torchtitan's default) instead of ~14 foreach
        # ops. DTensor plans the sharding of every op for each of its tensors on a run's first
        # step; on a 2-D mesh that took 1.7 s of a tiny model's first step for foreach, 0.7 for
        # fused (docs/decisions.md 79), and the kernel runs on the local shards directly, which
        # plans nothing (local_shard_adamw.py, decision 210). Elementwise either way, so as
        # independent of the layout.
        self.optimizer = LocalShardAdamW(param_groups_by_mesh(self.trained_parameters()), lr=opt.lr, betas=(opt.beta1, opt.beta2),
                                           eps=opt.eps, weight_decay=opt.weight_decay, fused=True)
        self.data = open_training_data(config, self.layout.data_rank_of(rank), self.layout.data_parallel_size)
        self.batch_hash = ""  # this rank's rows of the last batch, one digest each (plans/data/batch_hash.py)
        self.rank_tokens: int | None = None  # sft, dpo: this rank's rows' tokens of the last batch, padding left out
        self.step = 0  # steps completed: the data position and the lr schedule's state

    def _build_runner(self, plan: PipelinePlan | None, initialize: bool = True) -> StepRunner:
        config = self.config
        if self.layout.pp == 1:
            return SingleStageRunner.build(config, self.mesh, self.device, initialize)
        pipeline = config.pipeline
        plan = plan or build_pipeline_plan(config.model.spec, self.layout, pipeline.schedule, pipeline.microbatches,
                                           pipeline.stage_layout, pipeline.schedule_csv)
        return PipelinedRunner.build(config, plan, self.rank, self.mesh, self.device,
                                     pipeline.timeout_s or config.resources.collective_timeout_s, initialize)

    def trained_parameters(self) -> list:
        """The parameters the optimizer steps: those whose role is trained (a frozen base has none
        of AdamW's state, and no gradient to clip)."""
        trained = self.roles.trained_names
        return [param for name, param in self.model.named_parameters() if name in trained]

    @property
    def model(self):
        """The model parts this rank runs (the whole model, or its pipeline stages as one)."""
        return self.runner.model

    def _modules(self):
        """The torch modules this rank runs (its pipeline stages, or the whole model)."""
        return list(self.model.modules.values()) if hasattr(self.model, "modules") and isinstance(self.model.modules, dict) \
            else [self.model]

    @property
    def pipeline_copies(self):
        """Parameters this rank holds as copies of another stage's (the last stage's tied embedding)."""
        return self.runner.pipeline_copies

    # ---- training ---------------------------------------------------------------------------

    def train_step(self) -> StepMetrics:
        """One optimizer step on global batch number self.step."""
        config, opt = self.config, self.config.optimizer
        started = time.perf_counter()
        lr = learning_rate(self.step, opt.lr, opt.min_lr, opt.warmup_steps, opt.decay_steps or config.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        reset_peak_memory(self.device)
        self._seed_lora_dropout()
        total_loss, record = self._forward_backward()
        with self.runner.after_forward_backward():
            grad_norm = clip_grad_norm(self.trained_parameters(), opt.grad_clip, self.coord_map,
                                       timeout=self.runner.collective_timeout, copies=self.pipeline_copies)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            total_loss = self._mean_loss(total_loss)
            routing = self._routing_statistics()
            rewards = self._reward_metrics()
        computed = config.global_batch // self.layout.data_parallel_size * config.seq_len
        self.step += 1
        return StepMetrics(self.step, total_loss.item(), float(grad_norm), lr, time.perf_counter() - started, record,
                           tokens=self.rank_tokens if self.rank_tokens is not None else computed, computed_tokens=computed,
                           peak_memory_bytes=peak_memory_bytes(self.device), device_name=device_name(self.device),
                           batch_hash=self.batch_hash, rewards=rewards, **routing)

    def _seed_lora_dropout(self) -> None:
        """LoRA dropout's masks are drawn from (seed, step, the rank without its tp coordinate)
        (decisions 126, 168): a rerun, or a resume on this layout, draws the same ones, and every
        tp rank of a group draws the same, so tp and --sp leave the masks as the run without tp
        draws them (other dp, fsdp and pp splits draw others). Without tp the key is the rank."""
        if self.config.lora.dropout:
            torch.manual_seed((self.config.seed * 1_000_003 + self.step) * 65_537 + self.rank // self.layout.tp)

    def _batch(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """This data rank's microbatches of global batch number self.step."""
        config = self.config
        inputs, targets = self.data.rank_batch(self.step, self.layout.data_rank_of(self.rank), self.layout.data_parallel_size)
        self.batch_hash = row_hashes(inputs, targets)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        return list(inputs.chunk(config.pipeline.microbatches)), list(targets.chunk(config.pipeline.microbatches))

    def _forward_backward(self) -> tuple[torch.Tensor, StepRecord | None]:
        """Gradients of this step's batch, reduced over data ranks (and the tied embedding
        summed over its two stages); returns this rank's share of the loss."""
        inputs, targets = self._batch()
        self.rank_tokens = None  # packed windows: every position is a token
        if self.config.objective in ("sft", "dpo"):  # the mean's denominator: the global batch's completion targets, or pairs
            self.runner.criterion.set_step(self.data.global_loss_tokens(self.step))
            self.rank_tokens = self.data.rank_tokens(self.step)  # padding left out (decision 203)
        if self.config.objective == "dpo" and self.config.dpo.precomputed:  # no reference forward: read with the rows
            for rows in self.data.reference_logps.pop(self.step).to(self.device).chunk(self.config.pipeline.microbatches):
                self.runner.criterion.set_reference(rows)
        total_loss, record = self.runner.forward_backward(inputs, targets)
        if self.tp_partial:
            sum_partial_gradients(self.tp_partial, self.mesh["tp"], self.runner.collective_timeout)
        if self.experts:
            reduce_expert_gradients(self.experts, self.mesh, self.layout.dp, self.layout.data_parallel_size,
                                    self.runner.collective_timeout)
        return total_loss, record

    def _routing_statistics(self) -> dict:
        """An MoE model's step, the same on every rank: tokens each expert of each MoE layer got
        over the global batch, the mean balance loss (`actors/model/moe.py`), and the bytes the
        forward's token all-to-alls carried. One all-reduce over the world of a [layers,
        experts + 3] table; tokens and loss only from tp rank 0 (tp peers route the same tokens),
        bytes from every rank (each tp rank exchanges its own copy); pipeline stages fill their
        own layers' rows."""
        model = self.config.model.spec
        if not model.is_moe:
            return {}
        experts = model.n_experts
        table = torch.zeros(model.n_layers, experts + 3, dtype=torch.float64)
        for layer, router in self.routers:
            statistics = router.statistics
            if self.coords.tp == 0:
                table[layer, :experts] = statistics.tokens.double()
                table[layer, experts] = statistics.aux_sum / max(1, statistics.aux_count)
            table[layer, experts + 1:] = torch.tensor([statistics.exchanged_bytes, statistics.peer_bytes], dtype=torch.float64)
            statistics.reset()
        table = table.to(self.device)  # NCCL reduces device tensors only
        self.runner.wait(dist.all_reduce(table, async_op=True), "the routing statistics all-reduce")
        table = table.cpu()
        moe = list(model.moe_layers)
        aux = float(table[moe, experts].sum()) / (len(moe) * self.layout.data_parallel_size)
        return {"expert_tokens": {layer: [int(count) for count in table[layer, :experts].tolist()] for layer in moe},
                "aux_loss": aux, "all_to_all_bytes": int(table[:, experts + 1].sum()),
                "all_to_all_peer_bytes": int(table[:, experts + 2].sum())}

    def _reward_metrics(self) -> dict[str, float] | None:
        """--objective dpo: the step's rewards and accuracy, means over the global batch's pairs,
        reduced as the loss is (each rank's sums already carry data_ranks / pairs)."""
        if self.config.objective != "dpo":
            return None
        criterion = self.runner.criterion
        sums = criterion.rewards.to(self.device)
        self.runner.wait(dist.all_reduce(sums, async_op=True), "the DPO rewards all-reduce")
        means = (sums / (self.layout.world_size // self.layout.pp)).cpu().tolist()
        return dict(zip(REWARD_METRICS, means))

    def _mean_loss(self, total_loss: torch.Tensor) -> torch.Tensor:
        """Every rank reports the same number: the mean over data ranks. tp peers hold equal
        copies, and only the ranks running the last pipeline stage hold any."""
        self.runner.wait(dist.all_reduce(total_loss, async_op=True), "the loss all-reduce")
        return total_loss / (self.layout.world_size // self.layout.pp)

    # ---- test support -----------------------------------------------------------------------

    def full_gradients(self) -> dict:
        """The loss and every parameter's full gradient for this step's batch, before clipping;
        no optimizer step. Each rank returns the parameters it is the primary holder of, under
        their global names (tests compare layouts with this; keep models tiny)."""
        self._seed_lora_dropout()
        total_loss, _ = self._forward_backward()
        gradients = {}
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            full = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            if is_primary_replica(param, self.coord_map, self.pipeline_copies) and not any(self.coord_map.values()):
                gradients[name] = full.detach().cpu().clone()
        self.optimizer.zero_grad(set_to_none=True)
        for _, router in self.routers:
            router.statistics.reset()
        return {"loss": self._mean_loss(total_loss).item(), "gradients": gradients}

    # ---- checkpoints ------------------------------------------------------------------------

    def save_shard(self, checkpoint_url: str, file: str) -> ChunkTable:
        return save_rank_shard(self.model, self.optimizer, self.coord_map, checkpoint_url, file, self.pipeline_copies,
                               self.stored_names)

    @property
    def stored_names(self) -> frozenset[str] | None:
        """What the run's checkpoints hold (None: every parameter, as a run without a converter)."""
        return self.roles.stored_names if self.roles.has_frozen else None

    def load(self, checkpoint_url: str, manifest: bytes | None = None) -> dict:
        result = load_rank_shard(self.model, self.optimizer, checkpoint_url, set(self.roles.stored_names),
                                 manifest, handover=self.handover_groups, only=self.stored_names)
        self.step = result["step"]
        return {"step": result["step"], "bytes_read": result["bytes_read"], "bytes_needed": result.get("bytes_needed", 0),
                "bytes_received": result["bytes_received"], "seconds": result["seconds"],
                "partial_reads": result["partial_reads"]}

    def load_base(self, checkpoint_url: str) -> dict:
        """The frozen parameters' values from the run's base checkpoint (weights only, any layout);
        the step and moments stay the run's own."""
        frozen = self.roles.frozen_names
        view = FloatView(self.model, frozen)  # a bf16 base is read as float32, then rounded (decision 126)
        result = load_rank_shard(view, self.optimizer, checkpoint_url, set(frozen), handover=self.handover_groups,
                                 only=frozen, moments=False)
        view.write_back()
        return {"bytes_read": result["bytes_read"], "seconds": result["seconds"], "partial_reads": result["partial_reads"]}

    def load_reference(self, checkpoint_url: str) -> dict:
        """--objective dpo without LoRA: the reference's weights (a frozen copy, no moments) from
        the checkpoint the run started from, written by any layout."""
        reference = self.runner.reference
        # The whole model's names, as the policy's load expects (a pipeline rank holds some of them).
        names = set(self.roles.stored_names)
        result = load_rank_shard(reference, torch.optim.SGD(reference.parameters(), lr=0.0), checkpoint_url, names,
                                 handover=self.handover_groups, only=frozenset(names), moments=False)
        return {"bytes_read": result["bytes_read"], "seconds": result["seconds"], "partial_reads": result["partial_reads"]}

    @torch.no_grad()
    def reference_logprobs(self, dataset_url: str, rows: int = 8) -> list[float]:
        """`rayshard data reference-logprobs`: this (whole, loaded) model's summed response
        log-probability of every example of a preference dataset, in document order."""
        dataset = PreparedDataset(dataset_url, self.config.seq_len, preference=True)
        found = []
        for start in range(0, dataset.meta.documents, rows):
            windows, masks = dataset.read_examples(np.arange(start, min(start + rows, dataset.meta.documents)))
            windows, masks = torch.from_numpy(windows).to(self.device), torch.from_numpy(masks).to(self.device)
            targets = windows[:, 1:].masked_fill(~masks[:, 1:], IGNORE)
            with loss_context(self.layout.tp):
                found += sequence_logps(self.model(windows[:, :-1]).float(), targets).tolist()
        return found

    def data_fingerprint(self) -> str:
        return self.data.fingerprint()

    def groups_held(self) -> tuple:
        """What holds this rank's process groups: the default group, the root mesh (every mesh
        group is registered there) and the load's hand-over groups."""
        world = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
        return world, self.mesh, self.handover_groups

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_previous_meshes()
        forget_previous_compiles()
