"""What one rank does: build its shard of the model, train steps, save and load its chunks.

Independent of Ray so the same code runs under `torch.multiprocessing` in the orchestration
benchmark; `actors/rank.py` is the thin Ray actor around it.
"""
from __future__ import annotations

import contextlib
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from actors.checkpointing import load_rank_shard, save_rank_shard
from actors.data import corpus_fingerprint, load_corpus, rank_batch
from actors.init_weights import initialize_parameters
from actors.model import build_on_meta
from actors.parallelize import clip_grad_norm, parallelize
from plans.config import TrainConfig
from plans.layout import MESH_DIM_NAMES
from plans.lr_schedule import learning_rate
from plans.model_spec import parameter_shapes


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
    def __init__(self, config: TrainConfig, rank: int, init_method: str):
        torch.set_num_threads(1)
        self.config = config.validate()
        self.rank = rank
        self.layout = config.layout
        self.coords = self.layout.coords_of(rank)
        self.coord_map = {"dp": self.coords.dp, "fsdp": self.coords.fsdp, "tp": self.coords.tp}
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=self.layout.world_size,
                                timeout=timedelta(seconds=config.collective_timeout_s))
        self.mesh = init_device_mesh(self.device.type, self.layout.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
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

    # ---- training ---------------------------------------------------------------------------

    def train_step(self) -> dict:
        """One optimizer step on global batch number self.step; returns metrics."""
        config, opt = self.config, self.config.optimizer
        started = time.perf_counter()
        lr = learning_rate(self.step, opt.lr, opt.min_lr, opt.warmup_steps, opt.decay_steps or config.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        inputs, targets = rank_batch(self.corpus, config.seed, self.step, config.global_batch, config.seq_len,
                                     self.layout.data_rank_of(self.rank), self.layout.data_parallel_size)
        inputs, targets = inputs.to(self.device), targets.to(self.device)
        sharded = hasattr(self.model, "set_requires_gradient_sync")
        total_loss = torch.zeros((), device=self.device)
        for index, (x, y) in enumerate(zip(inputs.chunk(config.microbatches), targets.chunk(config.microbatches))):
            if sharded:  # reduce gradients once per step, on the last microbatch
                self.model.set_requires_gradient_sync(index == config.microbatches - 1)
            logits = self.model(x)
            with loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext():
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / config.microbatches
                loss.backward()
            total_loss += (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()
        grad_norm = clip_grad_norm(self.model.parameters(), opt.grad_clip, self.coord_map)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Every rank reports the same number: the mean over data ranks (tp peers hold equal copies).
        dist.all_reduce(total_loss)
        total_loss /= self.layout.world_size
        self.step += 1
        return {"step": self.step, "loss": total_loss.item(), "grad_norm": float(grad_norm), "lr": lr,
                "rank_seconds": time.perf_counter() - started}

    # ---- checkpoints ------------------------------------------------------------------------

    def save_shard(self, checkpoint_url: str, file: str) -> list[dict]:
        return save_rank_shard(self.model, self.optimizer, self.coord_map, checkpoint_url, file)

    def load(self, checkpoint_url: str) -> dict:
        result = load_rank_shard(self.model, self.optimizer, checkpoint_url, set(parameter_shapes(self.config.model)))
        self.step = result["step"]
        return {"step": result["step"], "bytes_read": result["bytes_read"]}

    def data_fingerprint(self) -> str:
        return corpus_fingerprint(self.corpus)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
