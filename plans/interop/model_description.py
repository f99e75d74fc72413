"""Which model a `rayshard.checkpoint` (API) checkpoint holds, and under which names.

A checkpoint saved from a training loop's state dict names its tensors by the loop's own module
names (decision 106: `model.<fqn>` -> (fqn, param), `optim.state.<fqn>.exp_avg` -> (fqn,
exp_avg)) and records no model configuration, which the offline tools need (a parameter's role
for a layout, a Hugging Face mapping). A description gives both: the model (a rayshard
`ModelConfig`) and the naming its fqns follow:

    rayshard    our own names (`layers.0.attention.qkv.weight`: what rayshard's model has)
    torchtitan  torchtitan's Llama (`layers.0.attention.wq.weight`, ...), through the mapping in
                `plans/interop/torchtitan.py` (decision 109)

It comes from the command line (`--model`, `--hf-config`, `--config`, `--names`) or from the
manifest, where `rayshard.checkpoint.save(..., model={...})` records it as JSON (decision 128):

    {"preset": "tiny"} | {"hf_config": {config.json's contents}} | {"config": {ModelConfig fields}}
    plus optionally "names": "rayshard" (default) or "torchtitan"

Pure: no torch, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.checkpoint.chunks import EXP_AVG, EXP_AVG_SQ, PARAM
from rayshard.plans.errors import CheckpointError
from rayshard.plans.interop.hf_families import model_config_from_hf
from rayshard.plans.interop.torchtitan import DERIVED_BUFFERS, torchtitan_mapping
from rayshard.plans.training.model_spec import ModelConfig, parameter_shapes, preset
from rayshard.plans.transforms.mapping import Meta

NAMES = ("rayshard", "torchtitan")
SOURCES = ("preset", "hf_config", "config")
MANIFEST_KEY = "model_description"  # where the manifest's metadata keeps it
MODEL_KINDS = (PARAM, EXP_AVG, EXP_AVG_SQ)  # what the offline tools carry; other kinds stay in the checkpoint


@dataclass(frozen=True)
class ModelDescription:
    """A model and the naming of its tensors in a checkpoint. `source` says where it came from,
    for messages (`--model tiny`, `recorded at save`)."""

    model: ModelConfig
    names: str = "rayshard"
    preset: str | None = None
    source: str = ""

    def record(self) -> dict:
        """What the manifest keeps (JSON): the resolved model, so a reader needs no preset table."""
        return {"model": self.model.to_dict(), "names": self.names, "preset": self.preset}

    @classmethod
    def from_record(cls, record, where: str) -> "ModelDescription":
        if not isinstance(record, dict) or not isinstance(record.get("model"), dict):
            raise CheckpointError(f"checkpoint {where}: its `{MANIFEST_KEY}` metadata is not a model description; the "
                                  "manifest is damaged. Fix: pass the model with --model, --hf-config or --config")
        try:
            model = ModelConfig.from_dict(record["model"]).validate()
        except Exception as error:
            raise CheckpointError(f"checkpoint {where}: its `{MANIFEST_KEY}` metadata does not describe a model "
                                  f"({type(error).__name__}: {error}). Fix: pass the model with --model, --hf-config "
                                  "or --config") from error
        return cls(model, _names(record.get("names", "rayshard"), where), record.get("preset"), "recorded at save")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's shape under this naming."""
        ours = parameter_shapes(self.model)
        if self.names == "rayshard":
            return {name: tuple(shape) for name, shape in ours.items()}
        plan = torchtitan_mapping(self.model).plan({name: Meta(tuple(shape), "float32") for name, shape in ours.items()})
        return {name: tuple(meta.shape) for name, meta in plan.outputs.items()}


def _names(names, where: str) -> str:
    if names not in NAMES:
        raise CheckpointError(f"{where}: names {names!r} is not a naming rayshard maps; one of {', '.join(NAMES)}. Fix: "
                              "give the naming the state dict's module names follow")
    return names


def describe(given: dict, where: str = "model") -> ModelDescription:
    """A description from what a caller of `save(..., model=...)` passes (see the module doc)."""
    if not isinstance(given, dict):
        raise CheckpointError(f"{where} must be a dict such as {{'preset': 'tiny'}} or {{'hf_config': {{...}}, "
                              f"'names': 'torchtitan'}}, not a {type(given).__name__}")
    unknown = sorted(set(given) - set(SOURCES) - {"names"})
    chosen = [key for key in SOURCES if key in given]
    if unknown or len(chosen) != 1:
        raise CheckpointError(f"{where} {sorted(given)}: give exactly one of {', '.join(SOURCES)} (and optionally "
                              f"names){'; unknown: ' + ', '.join(unknown) if unknown else ''}. Fix: e.g. "
                              "model={'preset': 'tiny'} or model={'hf_config': json.load(open('config.json'))}")
    names = _names(given.get("names", "rayshard"), where)
    key, value = chosen[0], given[chosen[0]]
    try:
        if key == "preset":
            return ModelDescription(preset(value), names, value, f"preset {value}")
        if key == "hf_config":
            if not isinstance(value, dict):
                raise CheckpointError("hf_config must be a config.json's contents (a dict)")
            return ModelDescription(model_config_from_hf(value, f"{where}['hf_config']"), names, None, "hf_config")
        return ModelDescription(ModelConfig.from_dict(value).validate(), names, None, "config")
    except CheckpointError:
        raise
    except Exception as error:  # an unknown preset, a config dict of the wrong fields
        raise CheckpointError(f"{where}[{key!r}] does not describe a model ({type(error).__name__}: {error}). Fix: "
                              "pass a preset name, a Hugging Face config.json's contents or ModelConfig fields") from error


def selected(name: str, kind: str, shapes: dict) -> bool:
    """Whether a checkpoint tensor is one the offline tools carry: a parameter's weight or AdamW
    moment. Per-parameter AdamW steps (the checkpoint has one step), other tensors and derived
    buffers (RoPE tables) stay where they are."""
    return kind in MODEL_KINDS and (name in shapes or name.rsplit(".", 1)[-1] not in DERIVED_BUFFERS)


def check_shapes(description: ModelDescription, found: dict[tuple[str, str], tuple[tuple[int, ...], str]],
                 where: str) -> list[str]:
    """The checkpoint's (name, kind) -> (shape, dtype) of selected tensors against the model:
    every weight present and shaped as the model says, each AdamW moment for all parameters or
    none, one dtype per kind. One error listing every difference. Returns the kinds present."""
    shapes = description.shapes()
    kinds = [kind for kind in MODEL_KINDS if any(k == kind for _, k in found)]
    problems = []
    missing = [name for name in shapes for kind in (kinds or [PARAM]) if (name, kind) not in found]
    unexpected = sorted(f"{name} ({kind})" for name, kind in found if name not in shapes)
    mismatched = sorted(f"{name} ({kind}): checkpoint {list(shape)}, model {list(shapes[name])}"
                        for (name, kind), (shape, _) in found.items() if name in shapes and tuple(shape) != shapes[name])
    dtypes = {kind: sorted({dtype for (_, k), (_, dtype) in found.items() if k == kind}) for kind in kinds}
    mixed = [f"{kind} in {', '.join(d)}" for kind, d in dtypes.items() if len(d) > 1]
    for title, entries in (("missing", sorted(f"{n}" for n in missing)), ("unexpected", unexpected),
                           ("shape mismatches", mismatched), ("mixed dtypes", mixed)):
        if entries:
            problems.append(f"{title} ({len(entries)}): {'; '.join(entries[:3])}{' ...' if len(entries) > 3 else ''}")
    if problems:
        example = next(iter(shapes))
        raise CheckpointError(f"checkpoint {where} does not hold {description.model.family} ({description.source}) under "
                              f"{description.names} names (e.g. {example}): {' | '.join(problems)}. Fix: pass the model "
                              "the checkpoint was saved from (--model, --hf-config or --config) and its naming (--names "
                              f"{'/'.join(NAMES)})")
    return kinds


def check_recorded_description(chunks, metadata: dict, where: str) -> None:
    """A `rayshard.checkpoint` manifest against the model description it recorded at save (what
    `ckpt verify` checks, as it checks a trainer's manifest against its `model`); nothing for a
    checkpoint that recorded none."""
    if "model" in metadata or MANIFEST_KEY not in metadata:
        return
    description = ModelDescription.from_record(metadata[MANIFEST_KEY], where)
    shapes = description.shapes()
    # One record per tensor (a ChunkTable answers column-wise), not per chunk.
    firsts = chunks.first_of_each_tensor().values() if hasattr(chunks, "first_of_each_tensor") else chunks
    found = {(c.name, c.kind): (tuple(c.global_shape), c.dtype) for c in firsts if selected(c.name, c.kind, shapes)}
    check_shapes(description, found, where)
