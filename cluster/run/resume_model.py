"""Which model a resume builds: the checkpoint's own, unless the user names one.

A checkpoint's metadata records the whole model (every size, not only a preset name), so a run
imported from Hugging Face with sizes no preset has, or trained with a config file the user no
longer passes, resumes without repeating them. A model the user names must equal the
checkpoint's; the refusal lists the fields that differ, before any actor starts.
"""
from __future__ import annotations

from dataclasses import replace

from rayshard.storage.manifest_io import read_manifest
from rayshard.cluster.catalog.store import Store
from rayshard.plans.config import ModelChoice, TrainConfig
from rayshard.plans.checkpoint.model_check import require_model_record
from rayshard.plans.errors import ConfigError
from rayshard.plans.training.model_spec import ModelConfig, model_differences


def checkpoint_model(config: TrainConfig, ref: str) -> tuple[str | None, ModelConfig] | None:
    """The (preset name, model) recorded by the checkpoint `ref` names, or None when `ref` is
    "auto" and the run has no checkpoint yet (it starts fresh)."""
    store = Store(config.store)
    if ref == "auto":
        if not store.committed_steps(config.run):
            return None
        ref = "latest"
    checkpoint = store.resolve(ref, current_run=config.run)
    metadata = read_manifest(checkpoint.url)[1]
    return metadata.get("model_preset"), ModelConfig.from_dict(require_model_record(metadata, checkpoint.url)).validate()


def with_resumed_model(config: TrainConfig, named: bool) -> TrainConfig:
    """`config` with the model its resume will load. named: the user chose the model (a --model
    flag or a model section in their own config file)."""
    if not config.checkpoint.resume:
        return config
    found = checkpoint_model(config, config.checkpoint.resume)
    if found is None:
        return config
    preset_name, saved = found
    if not named:
        given = config.model.vocab_size  # --vocab-size alone names no model, but must agree with the one resumed
        if given is not None and given != saved.vocab_size:
            raise ConfigError("model.vocab_size", given, f"differs from the checkpoint's model ({saved.vocab_size})",
                              "leave --vocab-size out (a resume builds the checkpoint's own model), or start a new --run")
        return replace(config, model=ModelChoice(preset_name or "custom", saved))
    differences = model_differences(saved, config.model.spec)
    if differences:
        raise ConfigError("model", config.model.preset, f"differs from the checkpoint's model in {', '.join(differences)}",
                          "leave the model out (a resume builds the checkpoint's own), or resume a checkpoint of this model")
    if config.model.spec.special_tokens is None and saved.special_tokens is not None:  # they travel with the weights
        return replace(config, model=replace(config.model, spec=replace(config.model.spec, special_tokens=saved.special_tokens)))
    return config
