"""A LoRA run's base: which checkpoint holds the frozen weights, its digest, and the checks on resume.

A LoRA run's checkpoints hold only the adapters, their moments and the step (their parameter
roles, plans/training/parameter_roles.py); they name their base in the manifest's metadata:
`lora` (the adapters' settings) and `lora_base` {"url": the committed base checkpoint, or None for
the seeded initial weights, "seed", "digest": the layout-free digest of the base's weights}. A
resume adopts both, and refuses, in one line, a base whose digest is not the recorded one (the
adapters were trained on other weights) and adapter settings that differ from the checkpoint's.

The digest is `cluster/checkpoint/digest.py`'s over the base's parameters (not its moments): the
driver streams the base's weights once per start or resume to compute it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.checkpoint.digest import weights_digest
from rayshard.plans.config import LoraConfig, TrainConfig
from rayshard.plans.errors import CheckpointError, ConfigError

SEEDED = "seeded initial weights"
# The settings that make two runs' adapters different tensors (dropout and the base ref do not).
ADAPTER_FIELDS = ("rank", "alpha", "targets")


@dataclass(frozen=True)
class LoraBase:
    """url: the committed base checkpoint (None: the seeded initial weights of `seed`)."""

    url: str | None
    seed: int
    digest: str

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return self.url or f"{SEEDED} (seed {self.seed})"


def base_digest(url: str) -> str:
    """The layout-free digest of a checkpoint's parameters (its moments left out)."""
    return weights_digest(url)


def with_resumed_lora(config: TrainConfig, metadata: dict | None) -> TrainConfig:
    """The run's lora settings: a resumed LoRA checkpoint's own unless given, refused where they
    differ from it; a full checkpoint resumed as LoRA, or the other way round, is refused."""
    if metadata is None:
        return config
    saved = metadata.get("lora")
    if saved is None:
        if config.lora.enabled:
            raise ConfigError("lora.rank", config.lora.rank, "the checkpoint resumed is a full-training checkpoint, not "
                              "a LoRA run's", "to fine-tune it with adapters start a new --run with --lora-base naming it "
                              "(and no --resume)")
        return config
    saved = LoraConfig(**{k: v for k, v in saved.items() if k in LoraConfig.__dataclass_fields__})
    if not config.lora.enabled:
        # The base is the recorded URL (`resolve_base`), not the ref first given: "RUN" may name a later checkpoint now.
        return replace(config, lora=replace(saved, base=config.lora.base))
    differences = [f"{name} ({getattr(saved, name)!r} -> {getattr(config.lora, name)!r})" for name in ADAPTER_FIELDS
                   if getattr(saved, name) != getattr(config.lora, name)]
    if differences:
        raise ConfigError("lora", f"rank {config.lora.rank}", f"differs from the checkpoint's adapters in "
                          f"{', '.join(differences)}", "leave the --lora-* flags out (a resume takes the checkpoint's), "
                          "or start a new --run")
    return config


def resolve_base(config: TrainConfig, store: Store, metadata: dict | None) -> LoraBase | None:
    """The base of a LoRA run (None for a run without adapters), checked against a resumed
    checkpoint's record."""
    if not config.lora.enabled:
        return None
    recorded = (metadata or {}).get("lora_base")
    ref = config.lora.base or (recorded or {}).get("url")
    url = store.resolve(ref, current_run=config.run).url if ref else None
    base = LoraBase(url, config.seed, base_digest(url) if url else f"{SEEDED}:{config.seed}")
    if recorded is not None and recorded.get("digest") != base.digest:
        raise CheckpointError(f"the LoRA base {base.describe()} has digest {base.digest[:19]}..., but the adapters "
                              f"resumed were trained on {recorded.get('url') or SEEDED} with digest "
                              f"{str(recorded.get('digest'))[:19]}...; they would not fit these weights. Fix: pass "
                              f"--lora-base {recorded.get('url') or '(nothing: the seeded weights)'} or start a new --run")
    return base
