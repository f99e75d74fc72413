"""The tensor-parallel plan as data: module-name patterns -> a style name.

One plan serves both sides: the actors turn each style into torch's ParallelStyle
(`actors/parallel/parallelize.py`), and the checkpoint planner reads from it which dimension of a
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
# Stacked experts [experts, out, in] (actors/model/moe.py): each tp rank holds every expert's share
# of hidden units, the pair (gate_up by rows, down by columns) needing one reduction as dense does.
EXPERT_COLWISE = "expert_colwise"      # stacked gate_up: dim 1 (each expert's output rows)
EXPERT_ROWWISE = "expert_rowwise"      # stacked down: dim 2 (each expert's input columns)

# Sequence parallelism (Megatron-LM's, torchtitan's): between the tensor-parallel matmuls the
# residual stream stays split over the sequence, so norms run on 1/tp of the tokens and each
# rank keeps 1/tp of those activations. Its styles are the TP styles with sequence-sharded ends:
ROWWISE_TO_SEQUENCE = "rowwise_to_sequence"                # row-parallel, output reduce-scattered on the sequence
VOCAB_EMBEDDING_TO_SEQUENCE = "vocab_embedding_to_sequence"
VOCAB_HEAD_FROM_SEQUENCE = "vocab_head_from_sequence"      # gathers the sequence before the head
SEQUENCE_PARALLEL = "sequence_parallel"                    # a norm computed on the sequence shard
# A norm on the sequence shard whose output rejoins the residual stream, which between blocks is
# the rank's plain shard (the row-parallel outputs' form): Gemma's post-sublayer norms.
SEQUENCE_PARALLEL_TO_LOCAL = "sequence_parallel_to_local"
GATHER_SEQUENCE = "gather_sequence"                        # a module whose input is gathered from sequence shards
# Learned positions under sequence parallelism (GPT-2, decision 132): the table is copied on every
# tp rank, looked up for the whole sequence, and each rank keeps its sequence shard's rows.
POSITIONS_TO_SEQUENCE = "positions_to_sequence"

# The styles that split the vocabulary: the only splits tp need not divide (their DTensors shard
# unevenly, `plans/training/tp_fit.py`).
VOCAB_STYLES = frozenset({VOCAB_EMBEDDING, VOCAB_HEAD, VOCAB_EMBEDDING_TO_SEQUENCE, VOCAB_HEAD_FROM_SEQUENCE})

# LoRA adapters (plans/training/lora.py): A [r, in] and B [out, r] beside a split base weight. Only
# their parameters are placed; the adapter's forward computes on local pieces (actors/model/lora.py).
LORA_COLWISE = "lora_colwise"    # beside a column-parallel base: B split by rows (the base's output), A copied
LORA_ROWWISE = "lora_rowwise"    # beside a row-parallel base: A split by columns (the base's input), B copied
# Under --sp, beside a base whose output is reduce-scattered on the sequence: the delta is cut to the
# rank's sequence shard as well (same parameter split).
LORA_ROWWISE_TO_SEQUENCE = "lora_rowwise_to_sequence"
ADAPTER_SPLIT = {LORA_COLWISE: ("b", 0), LORA_ROWWISE: ("a", 1),  # style -> (the parameter split, its dim)
                 LORA_ROWWISE_TO_SEQUENCE: ("a", 1)}

# Which weight dimension each style splits; a parameter under no pattern is copied on every tp rank.
WEIGHT_SPLIT_DIM = {COLWISE: 0, ROWWISE: 1, VOCAB_EMBEDDING: 0, VOCAB_HEAD: 0, EXPERT_COLWISE: 1, EXPERT_ROWWISE: 2,
                    ROWWISE_TO_SEQUENCE: 1, VOCAB_EMBEDDING_TO_SEQUENCE: 0, VOCAB_HEAD_FROM_SEQUENCE: 0}

DEFAULT_TP_STYLES: dict[str, str] = {
    "tok_embeddings": VOCAB_EMBEDDING,
    "layers.*.attention.qkv": COLWISE,
    "layers.*.attention.wo": ROWWISE,
    "layers.*.feed_forward.gate_up": COLWISE,
    "layers.*.feed_forward.down": ROWWISE,
    "layers.*.feed_forward.up": COLWISE,  # the GELU feed-forward's (actors/model/gelu_mlp.py)
    # Mixture-of-experts layers: the stacked experts, and the shared expert as a dense feed-forward.
    "layers.*.feed_forward.experts.gate_up": EXPERT_COLWISE,
    "layers.*.feed_forward.experts.down": EXPERT_ROWWISE,
    "layers.*.feed_forward.shared.gate_up": COLWISE,
    "layers.*.feed_forward.shared.down": ROWWISE,
    "output": VOCAB_HEAD,
}


# The sequence-parallel form of each TP style whose end meets the residual stream.
_TO_SEQUENCE = {ROWWISE: ROWWISE_TO_SEQUENCE, VOCAB_EMBEDDING: VOCAB_EMBEDDING_TO_SEQUENCE,
                VOCAB_HEAD: VOCAB_HEAD_FROM_SEQUENCE, LORA_ROWWISE: LORA_ROWWISE_TO_SEQUENCE}
# What sequence parallelism adds for the reference model: its residual-stream norms, and the
# blocks' two halves, whose column-parallel matmuls need the whole sequence.
SEQUENCE_PARALLEL_ADDITIONS: dict[str, str] = {
    "layers.*.attention_norm": SEQUENCE_PARALLEL,
    "layers.*.ffn_norm": SEQUENCE_PARALLEL,
    # Gemma's post-sublayer norms (ModelConfig.post_norms): on the row-parallel outputs' sequence shards.
    "layers.*.post_attention_norm": SEQUENCE_PARALLEL_TO_LOCAL,
    "layers.*.post_ffn_norm": SEQUENCE_PARALLEL_TO_LOCAL,
    "norm": SEQUENCE_PARALLEL,
    "layers.*.attention": GATHER_SEQUENCE,
    "layers.*.feed_forward": GATHER_SEQUENCE,
    "pos_embeddings": POSITIONS_TO_SEQUENCE,
}


def with_sequence_parallel(tp_styles: dict[str, str], additions: dict[str, str] = SEQUENCE_PARALLEL_ADDITIONS
                           ) -> dict[str, str]:
    """The TP plan with sequence parallelism, derived rather than written again: each style that
    feeds or reads the residual stream takes its sequence-sharded form, and the norms and the
    gathers are added. Weight split dims are unchanged, so checkpoints do not see SP."""
    return {**{pattern: _TO_SEQUENCE.get(style, style) for pattern, style in tp_styles.items()}, **additions}


def module_style(module_name: str, plan: dict[str, str] = DEFAULT_TP_STYLES) -> str | None:
    """The style of the module `module_name` (fnmatch patterns, as `parallelize_module` is given
    them), or None when tensor parallelism leaves it whole."""
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module_name, pattern):
            return style
    return None


ALL_STYLES = frozenset({COLWISE, ROWWISE, VOCAB_EMBEDDING, VOCAB_HEAD, EXPERT_COLWISE, EXPERT_ROWWISE, ROWWISE_TO_SEQUENCE, VOCAB_EMBEDDING_TO_SEQUENCE,
                        VOCAB_HEAD_FROM_SEQUENCE, SEQUENCE_PARALLEL, SEQUENCE_PARALLEL_TO_LOCAL, GATHER_SEQUENCE, POSITIONS_TO_SEQUENCE,
                        LORA_COLWISE, LORA_ROWWISE, LORA_ROWWISE_TO_SEQUENCE})


def tp_split_dim(parameter_name: str) -> int | None:
    """The dimension tensor parallelism splits this parameter of the reference model along
    (global name, e.g. `layers.3.attention.wo.weight`), or None when every tp rank holds all of it."""
    return split_dim_under(parameter_name, _DEFAULT_PAIRS)


_DEFAULT_PAIRS = tuple(DEFAULT_TP_STYLES.items())


@lru_cache(maxsize=8192)
def split_dim_under(parameter_name: str, styles: tuple[tuple[str, str], ...]) -> int | None:
    """`tp_split_dim` under any plan's styles (ordered (pattern, style) pairs: a user model's)."""
    module, _, leaf = parameter_name.rpartition(".")
    style = module_style(module, dict(styles))
    if style is None:
        return None
    if style in ADAPTER_SPLIT:
        split_leaf, dim = ADAPTER_SPLIT[style]
        return dim if leaf == split_leaf else None
    if leaf == "weight":
        return WEIGHT_SPLIT_DIM.get(style)  # sequence-parallel styles split no weight
    # A column-parallel Linear's bias follows its output rows; a row-parallel one's is whole.
    return 0 if leaf == "bias" and style in (COLWISE, VOCAB_HEAD) else None
