"""A config.json's RoPE parameters and scaling, read as transformers reads them (every family that
rotates: the Llama-like ones in `hf_families.py`, Gemma's global and local tables in `hf_gemma.py`)."""
from __future__ import annotations

from rayshard.plans.errors import CheckpointError, ConfigError
from rayshard.plans.training.rope_scaling import FIELDS_OF, ROPE_TYPES, RopeScaling


def rope_from_hf(config: dict, head_dim: int, where: str) -> tuple[dict, RopeScaling | None]:
    """The RoPE parameters of a config.json and their scaling, read as transformers reads them:
    4.x's rope_scaling wins over 5's rope_parameters where both are given, an old `type` key
    names the type, original_max_position_embeddings defaults to max_position_embeddings (a
    top-level one wins, as Phi-3 writes it), and keys the type does not read are ignored. A type
    or setting rayshard does not compute is refused naming the key."""
    key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = dict(config.get(key) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    # Phi-3's config (and Phi-4-mini's, top-level) carries it even with default RoPE.
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        where_set = f"{key}.partial_rotary_factor" if "partial_rotary_factor" in rope else "partial_rotary_factor"
        raise CheckpointError(f"{where}: this model uses {where_set}={partial!r} (RoPE on part of each head), which "
                              "rayshard does not implement; importing it would change what the weights compute")
    if rope_type in ("default", None):
        return rope, None
    if rope_type not in ROPE_TYPES:
        raise CheckpointError(f"{where}: this model uses {key}.rope_type={rope_type!r}, which rayshard does not "
                              f"implement (it computes default, {', '.join(ROPE_TYPES)}); importing it would change what "
                              "the weights compute")
    if rope_type in ("yarn", "llama3"):
        if config.get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", config.get("max_position_embeddings", 2048))
    fields = {name: rope[name] for name in FIELDS_OF[rope_type] if rope.get(name) is not None}
    try:
        scaling = RopeScaling(rope_type=rope_type, **fields).validate(config.get("max_position_embeddings", 2048),
                                                                      head_dim, where=key)
    except ConfigError as error:
        raise CheckpointError(f"{where}: {error}") from None
    return rope, scaling
