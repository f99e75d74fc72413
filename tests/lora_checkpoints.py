"""A LoRA run's checkpoint as a run writes it, without a run: what the merge and PEFT export
tests of built-in families and users' models share."""
from __future__ import annotations

from dataclasses import asdict

import torch

from rayshard.actors.checkpoint.save import save_rank_shard
from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.digest import weights_digest
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.config import LoraConfig
from rayshard.plans.layout.parallel_layout import ParallelLayout


def commit_lora_checkpoint(store_url: str, run: str, model: torch.nn.Module, model_description: dict, lora: LoraConfig,
                           base_url: str, vocab_size: int, seed: int = 4) -> str:
    """`model` (the base's weights, adapters applied): its adapters drawn at random (B nonzero:
    every adapter acts), one AdamW step for real moments, and only they committed as `run@1`
    with the manifest's lora and lora_base, as a LoRA run writes them. Returns the URL."""
    generator = torch.Generator().manual_seed(seed)
    adapters = {name: param for name, param in model.named_parameters() if ".lora." in f".{name}"}
    assert adapters, "no adapters applied"
    with torch.no_grad():
        for param in adapters.values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    optimizer = torch.optim.AdamW(adapters.values(), lr=1e-3)
    tokens = torch.randint(0, vocab_size, (2, 12), generator=generator)
    torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()
    pending = Store(store_url).begin(run, 1)
    rows = save_rank_shard(model, optimizer, {}, pending.url, pending.file_for(0), only=frozenset(adapters))
    metadata = {"run": run, "step": 1, "layout": ParallelLayout().to_dict(), "model": model_description,
                "model_preset": None, "lora": asdict(lora),
                "lora_base": {"url": base_url, "seed": 0, "digest": weights_digest(base_url)}}
    return pending.commit([Chunk.from_row(row) for row in rows], metadata)
