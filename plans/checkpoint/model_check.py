"""Does a checkpoint hold exactly the tensors a model has? One error that lists every missing
key, every unexpected key and every shape or dtype mismatch together, so one look says what is
wrong, instead of a failure at the first tensor a reader happens to reach."""
from __future__ import annotations

from rayshard.plans.checkpoint.chunk_table import ChunkTable
from rayshard.plans.checkpoint.chunks import Chunk
from rayshard.plans.checkpoint.state_dict_keys import SEPARATOR, column_of, key_of
from rayshard.plans.errors import CheckpointError
from rayshard.plans.training.lora import adapter_planning_model, recorded_adapter_shapes
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
    if missing or unexpected or mismatched:  # one line (a person reads it in a terminal, a log greps it)
        sections = [f"{title} ({len(entries)}): " + "; ".join(entries[:SHOWN]) + (" ..." if len(entries) > SHOWN else "")
                    for title, entries in (("missing keys", missing), ("unexpected keys", unexpected),
                                           ("shape/dtype mismatches", mismatched)) if entries]
        raise CheckpointError(f"checkpoint {where} does not match the model: {'. '.join(sections)}. Fix: {fix}.")


def require_model_record(metadata: dict, where: str) -> dict:
    """The checkpoint's `model` metadata; a checkpoint `rayshard.checkpoint` saved from a training
    loop's state dict has none, and is refused in one line saying what to do instead."""
    if "model" not in metadata and metadata.get("writer") == "rayshard.checkpoint":
        raise CheckpointError(
            f"checkpoint {where} was saved by rayshard.checkpoint from a training loop's state dict under the loop's own "
            "names, which this command does not read (the trainer resumes checkpoints that record its model). Fix: "
            "`rayshard ckpt reshard` it into a run of its own with --to LAYOUT --run NAME (and --model PRESET, --hf-config "
            "DIR or --config FILE, plus --names torchtitan for torchtitan's names, unless it was saved with model=...) "
            "and resume that run, or load it with rayshard.checkpoint.load into your model on any layout")
    if "model" not in metadata:
        raise CheckpointError(f"checkpoint {where}: its manifest's metadata has no `model` entry, so the manifest is "
                              "damaged (every trainer, import and reshard records one). Fix: restore the manifest, or "
                              "use an earlier checkpoint")
    return metadata["model"]


def check_against_own_model(chunks: ChunkTable | list[Chunk], metadata: dict, where: str) -> ModelConfig:
    """The manifest against the model its metadata records: every parameter, and every kind of
    state the checkpoint holds for any parameter (AdamW moments), with the recorded shapes and one
    dtype per kind. Offline tools (plan, reshard, export) read whole tensors by name; a manifest
    that lost rows would otherwise fail at the first one missing, or be copied incomplete.
    Returns the model, for the caller to plan with."""
    record = require_model_record(metadata, where)
    try:
        model = ModelConfig.from_dict(record)
        # A LoRA run's checkpoint stores only its adapters (their roles, plans/training/parameter_roles.py).
        shapes = recorded_adapter_shapes(model, metadata["lora"]) if metadata.get("lora") else parameter_shapes(model)
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


def check_state_dict_matches(tensors: dict[str, tuple[tuple[int, ...], str]], value_keys, stored: dict, stored_values,
                             where: str) -> None:
    """A state dict a load fills against the checkpoint, in one line naming the first key that
    differs (and how many more do). tensors: key -> (global shape, dtype) of each tensor to fill;
    value_keys: its non-tensor keys; stored: (name, kind) -> (global shape, dtype) of every stored
    tensor; stored_values: the keys of the stored non-tensor values. Stored tensors and values the
    state dict does not ask for are left alone (a partial load, as with DCP)."""
    problems = []
    for key, (shape, dtype) in tensors.items():
        found = stored.get(column_of(key))
        if found is None:
            inside = next((value for value in stored_values if key.startswith(value + ".")), None)
            problems.append(f"{key!r} is a value in the checkpoint, not a tensor" if key in stored_values else
                            f"{key!r} is inside the value {inside!r} in the checkpoint, not a tensor" if inside else
                            f"{key!r} is not in the checkpoint")
        elif (tuple(found[0]), found[1]) != (tuple(shape), dtype):
            problems.append(f"{key!r} is {found[1]}{list(found[0])} in the checkpoint but {dtype}{list(shape)} in the "
                            "state dict")
    for key in value_keys:
        if key not in stored_values:
            # A value where the checkpoint holds tensors beneath it (a nested dict of numbers where
            # tensors were saved): named as such, not as missing.
            beneath = None if column_of(key) in stored else next(
                (key_of(*column) for column in stored if key_of(*column).startswith(key + SEPARATOR)), None)
            problems.append(f"{key!r} is a tensor in the checkpoint, not a value" if column_of(key) in stored else
                            f"{key!r} holds values in the state dict where the checkpoint holds tensors "
                            f"({beneath!r} ...)" if beneath else
                            f"{key!r} is not in the checkpoint")
    if problems:
        more = f" (and {len(problems) - 1} more: {'; '.join(problems[1:4])}{' ...' if len(problems) > 4 else ''})" \
            if len(problems) > 1 else ""
        raise CheckpointError(f"{where}: the state dict does not match the checkpoint: {problems[0]}{more}. Fix: build "
                              "the model and optimizer the checkpoint was saved from (any layout), or load a "
                              "checkpoint of this model")


def model_to_plan(chunks, metadata: dict, where: str) -> ModelConfig:
    """`check_against_own_model`, as the offline planners (`ckpt reshard`, `ckpt plan`) must see
    it: a LoRA checkpoint's adapters alone (`plans/training/lora.py`), any other its model."""
    model = check_against_own_model(chunks, metadata, where)
    return adapter_planning_model(model, metadata["lora"]) if metadata.get("lora") else model
