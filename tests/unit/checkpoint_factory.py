"""A real checkpoint written by one process (no Ray, no process group): a trained model plus
AdamW moments, saved through the rank save path and committed like training commits."""
from __future__ import annotations

import torch

from rayshard.actors.checkpoint.save import save_rank_shard
from rayshard.actors.parallel.init_weights import initialize_parameters
from rayshard.actors.model.transformer import Transformer
from rayshard.cluster.catalog.store import Store
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.layout.parallel_layout import ParallelLayout
from rayshard.plans.training.model_spec import ModelConfig


def trained_model(config: ModelConfig, steps: int = 2, seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(config)
    initialize_parameters(model, seed, config.n_layers)  # the trainer's init: logits of realistic size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        tokens = torch.randint(0, config.vocab_size, (2, 12))
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def write_checkpoint(store_url: str, run: str, config: ModelConfig, steps: int = 2, seed: int = 0):
    """Returns (checkpoint url, model, optimizer)."""
    model, optimizer = trained_model(config, steps, seed)
    store = Store(store_url)
    pending = store.begin(run, steps)
    rows = save_rank_shard(model, optimizer, {}, pending.url, pending.file_for(0))
    metadata = {"run": run, "step": steps, "layout": ParallelLayout().to_dict(), "model": config.to_dict(),
                "model_preset": None}
    return pending.commit([Chunk.from_row(row) for row in rows], metadata), model, optimizer


def write_user_checkpoint(store_url: str, run: str, factory: str, seed: int = 0):
    """A user model's checkpoint (`--model-factory`): the factory's module built on the CPU with
    every parameter drawn at random (norms and biases too, so a mapping that swaps two of them
    shows), one AdamW step for real moments. Returns (checkpoint url, model, optimizer)."""
    from rayshard.actors.model.user_model import describe_factory, import_factory

    config = describe_factory(factory)
    torch.manual_seed(seed)
    model = import_factory(factory)().module
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (2, 12))
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
    store = Store(store_url)
    pending = store.begin(run, 1)
    rows = save_rank_shard(model, optimizer, {}, pending.url, pending.file_for(0))
    metadata = {"run": run, "step": 1, "layout": ParallelLayout().to_dict(), "model": config.to_dict(),
                "model_preset": None}
    return pending.commit([Chunk.from_row(row) for row in rows], metadata), model, optimizer
