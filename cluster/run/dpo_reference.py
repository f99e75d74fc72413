"""A DPO run's reference: which weights the policy is compared with, their digest, and the check on
resume (decision 159).

With LoRA the reference is the base with the adapters disabled: it is the run's LoRA base
(cluster/run/lora_base.py), recorded by its URL and digest. Without LoRA it is a frozen copy of
the weights the run started from: the checkpoint the run's first start resumed when that was not
a DPO checkpoint (an imported model, an SFT run's), or the seeded initial weights of a fresh run.
Checkpoints record it as `dpo_reference` {"kind", "url", "seed", "digest"}; a resume adopts it and
refuses, in one line, a reference whose digest is no longer the recorded one.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from rayshard.cluster.catalog.store import Store
from rayshard.cluster.run.lora_base import SEEDED, LoraBase, base_digest
from rayshard.plans.config import TrainConfig
from rayshard.plans.errors import CheckpointError

ADAPTERS_DISABLED, FROZEN_COPY = "adapters-disabled", "frozen-copy"


@dataclass(frozen=True)
class DpoReference:
    """kind: ADAPTERS_DISABLED (the LoRA base) or FROZEN_COPY; url: the checkpoint holding its
    weights (None: the seeded initial weights of `seed`)."""

    kind: str
    url: str | None
    seed: int
    digest: str

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        where = self.url or f"{SEEDED} (seed {self.seed})"
        return f"{where}, {'the LoRA base with adapters disabled' if self.kind == ADAPTERS_DISABLED else 'a frozen copy'}"


def resolve_reference(config: TrainConfig, store: Store, metadata: dict | None, resumed_url: str | None,
                      lora_base: LoraBase | None) -> DpoReference | None:
    """The reference of a DPO run (None for another objective). metadata and resumed_url: the
    checkpoint this start resumes, if any."""
    if config.objective != "dpo":
        return None
    if lora_base is not None:
        return DpoReference(ADAPTERS_DISABLED, lora_base.url, lora_base.seed, lora_base.digest)
    recorded = (metadata or {}).get("dpo_reference")
    if recorded is None:  # the run's first DPO start: the weights it starts from are the reference
        url = resumed_url
    else:
        url = recorded.get("url")
        if recorded.get("kind") != FROZEN_COPY:
            raise CheckpointError(f"{resumed_url} is a LoRA DPO checkpoint (reference: the base with adapters disabled), "
                                  "but this run has no adapters. Fix: resume it with its --lora-* settings, or start a new --run")
    seed = int(recorded.get("seed", config.seed)) if recorded is not None else config.seed
    if url is None and seed != config.seed:  # the frozen copy is built from this run's seed
        raise CheckpointError(f"{resumed_url} was trained against the seeded initial weights of seed {seed}, but this "
                              f"run's seed is {config.seed}. Fix: pass --seed {seed}, or start a new --run")
    reference = DpoReference(FROZEN_COPY, url, seed, base_digest(url) if url else f"{SEEDED}:{seed}")
    if recorded is not None and recorded.get("digest") != reference.digest:
        raise CheckpointError(f"the DPO reference {reference.describe()} has digest {reference.digest[:19]}..., but "
                              f"{resumed_url} was trained against digest {str(recorded.get('digest'))[:19]}... (the "
                              "reference checkpoint changed or is another model's). Fix: restore it, or start a new --run")
    return reference
