"""The tensor-parallel plan as data: module-name patterns -> a style name.

One plan serves both sides: the actors turn each style into torch's ParallelStyle
(`actors/model/parallelize.py`), and the checkpoint planner reads from it which dimension of a
weight tensor parallelism splits (`plans/checkpoint/regions.py`), so the two cannot disagree.

Why these styles: qkv and gate_up are column-parallel (their row blocks are whole head groups /
hidden units, see plans/training/model_spec.py), wo and down row-parallel so the pair needs one
all-reduce; the embedding is vocab-parallel, and the LM head leaves logits sharded over the
vocabulary so the loss runs under `loss_parallel` without ever gathering full logits.
"""
from __future__ import annotations

import fnmatch
from functools import lru_cache

COLWISE = "colwise"                    # nn.Linear, output features split: weight rows
ROWWISE = "rowwise"                    # nn.Linear, input features split: weight columns
VOCAB_EMBEDDING = "vocab_embedding"    # nn.Embedding split over the vocabulary (rows)
VOCAB_HEAD = "vocab_head"              # column-parallel LM head whose logits stay vocab-sharded

# Which weight dimension each style splits; a parameter under no pattern is copied on every tp rank.
WEIGHT_SPLIT_DIM = {COLWISE: 0, ROWWISE: 1, VOCAB_EMBEDDING: 0, VOCAB_HEAD: 0}

DEFAULT_TP_STYLES: dict[str, str] = {
    "tok_embeddings": VOCAB_EMBEDDING,
    "layers.*.attention.qkv": COLWISE,
    "layers.*.attention.wo": ROWWISE,
    "layers.*.feed_forward.gate_up": COLWISE,
    "layers.*.feed_forward.down": ROWWISE,
    "output": VOCAB_HEAD,
}


def module_style(module_name: str, plan: dict[str, str] = DEFAULT_TP_STYLES) -> str | None:
    """The style of the module `module_name` (fnmatch patterns, as `parallelize_module` is given
    them), or None when tensor parallelism leaves it whole."""
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module_name, pattern):
            return style
    return None


@lru_cache(maxsize=4096)
def tp_split_dim(parameter_name: str) -> int | None:
    """The dimension tensor parallelism splits this parameter along (global name, e.g.
    `layers.3.attention.wo.weight`), or None when every tp rank holds all of it."""
    module, _, leaf = parameter_name.rpartition(".")
    style = module_style(module)
    if style is None:
        return None
    if leaf == "weight":
        return WEIGHT_SPLIT_DIM[style]
    # A column-parallel Linear's bias follows its output rows; a row-parallel one's is whole.
    return 0 if leaf == "bias" and style in (COLWISE, VOCAB_HEAD) else None
