"""A model seen with some parameters as float32 copies, for loads into parameters kept in another dtype.

A LoRA run in bf16 keeps its frozen base in bf16 (decision 126), while checkpoints hold float32.
The load reads into float32 copies with the same placements (a DTensor's local shard converted),
then `write_back` rounds them into the parameters: the read path, its checks and its dtype rule
(a stored chunk fills a tensor of its own dtype) stay as they are, at the cost of one float32
copy of the rank's shard of those parameters while the load runs.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch

from rayshard.actors.checkpoint.rank_pieces import ties_embeddings
from rayshard.actors.parallel.shards import local_tensor


class FloatView:
    """`model` as load_rank_shard sees it: `named_parameters()` with the parameters in `names` whose
    dtype is not float32 replaced by float32 copies (one per parameter object)."""

    def __init__(self, model, names: frozenset[str]):
        self.model = model
        self.tie_embeddings = ties_embeddings(model)
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, param in model.named_parameters():
            if name in names and param.dtype != torch.float32 and id(param) not in self.copies:
                self.copies[id(param)] = (param, param.detach().to(torch.float32))

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.model.named_parameters():
            yield name, self.copies[id(param)][1] if id(param) in self.copies else param

    def parameters(self) -> Iterator[torch.Tensor]:
        for _, param in self.named_parameters():
            yield param

    @torch.no_grad()
    def write_back(self) -> None:
        for param, copy in self.copies.values():
            local_tensor(param).copy_(local_tensor(copy))
