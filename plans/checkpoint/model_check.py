"""Does a checkpoint hold exactly the tensors a model has? One error that lists every missing
key, every unexpected key and every shape or dtype mismatch together, so one look says what is
wrong, instead of a failure at the first tensor a reader happens to reach."""
from __future__ import annotations

from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.errors import CheckpointError
from rayshard.plans.training.model_spec import ModelConfig, parameter_shapes

SHOWN = 20


def raise_if_mismatched(expected: dict, found: dict, possible: set, where: str,
                        fix: str = "resume with the model settings the checkpoint was written with (`model` in its manifest metadata)") -> None:
    """expected, found: (name, kind) -> (shape, dtype); possible: every key some rank of the
    model could hold (a key outside it is unexpected; one only outside `expected` is another
    pipeline stage's)."""
    missing = sorted(f"{n} ({k})" for n, k in expected.keys() - found.keys())
    unexpected = sorted(f"{n} ({k})" for n, k in found.keys() - possible)
    mismatched = sorted(f"{n} ({k}): checkpoint {found[(n, k)][1]}{list(found[(n, k)][0])}, "
                        f"model {expected[(n, k)][1]}{list(expected[(n, k)][0])}"
                        for n, k in expected.keys() & found.keys() if found[(n, k)] != expected[(n, k)])
    if missing or unexpected or mismatched:
        lines = [f"checkpoint {where} does not match the model:"]
        for title, entries in (("missing keys", missing), ("unexpected keys", unexpected),
                               ("shape/dtype mismatches", mismatched)):
            if entries:
                lines.append(f"  {title} ({len(entries)}): " + "; ".join(entries[:SHOWN])
                             + (" ..." if len(entries) > SHOWN else ""))
        lines.append(f"  Fix: {fix}.")
        raise CheckpointError("\n".join(lines))


def check_against_own_model(chunks: ChunkTable | list[Chunk], metadata: dict, where: str) -> ModelConfig:
    """The manifest against the model its metadata records: every parameter, and every kind of
    state the checkpoint holds for any parameter (AdamW moments), with the recorded shapes and one
    dtype per kind. Offline tools (plan, reshard, export) read whole tensors by name; a manifest
    that lost rows would otherwise fail at the first one missing, or be copied incomplete.
    Returns the model, for the caller to plan with."""
    try:
        model = ModelConfig.from_dict(metadata["model"])
        shapes = parameter_shapes(model)
    except Exception as error:  # a damaged entry fails in many ways (wrong types, zero heads, ...)
        raise CheckpointError(f"checkpoint {where}: its `model` metadata does not describe a model "
                              f"({type(error).__name__}: {error}); the manifest is damaged. "
                              "Fix: use another checkpoint of the run (`rayshard ckpt ls`)") from error
    # A ChunkTable answers column-wise (a record per tensor); a list is read record by record.
    lasts = chunks.first_of_each_tensor(last=True) if isinstance(chunks, ChunkTable) else None
    found = ({key: (c.global_shape, c.dtype) for key, c in lasts.items()} if lasts is not None
             else {(c.name, c.kind): (c.global_shape, c.dtype) for c in chunks})
    dtypes = {kind: dtype for (_, kind), (_, dtype) in sorted(found.items())}
    expected = {(name, kind): (shape, dtypes[kind]) for name, shape in shapes.items() for kind in dtypes}
    raise_if_mismatched(expected, found, set(expected), where,
                        "the manifest lost or gained rows, or its `model` metadata is not the model that wrote it; "
                        "use another checkpoint of the run (`rayshard ckpt ls`)")
    return model
