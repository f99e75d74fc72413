"""The token ids a model's users need besides its weights: where a sequence begins (bos), where it
ends (eos: one id or several, as Llama 3's instruct models stop at any of three) and what pads a
batch. transformers keeps them in config.json and generation_config.json; `generate()` stops at
eos only if they say it.

A model imported from Hugging Face keeps its config.json's ids in its ModelConfig, so they travel
through training into every checkpoint and back out at export; a model trained from scratch on a
prepared dataset takes its tokenizer's at export (cluster/checkpoint/hf_interop.py). They change
nothing the model computes, so a resume never refuses over them (`model_differences`).
"""
from __future__ import annotations

from dataclasses import dataclass

from rayshard.plans.errors import ConfigError


@dataclass(frozen=True)
class SpecialTokens:
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()  # several where the model stops at any of them
    pad_token_id: int | None = None

    def __post_init__(self):
        eos = self.eos_token_id
        if eos is None:
            eos = ()
        elif isinstance(eos, int) and not isinstance(eos, bool):
            eos = (eos,)
        elif isinstance(eos, list):
            eos = tuple(eos)
        object.__setattr__(self, "eos_token_id", eos)

    @classmethod
    def from_dict(cls, data, where: str = "model.special_tokens") -> "SpecialTokens":
        if isinstance(data, SpecialTokens):
            return data
        known = ("bos_token_id", "eos_token_id", "pad_token_id")
        if not isinstance(data, dict) or set(data) - set(known):
            raise ConfigError(where, data, f"must be a mapping of {', '.join(known)}",
                              "write e.g. {bos_token_id: 1, eos_token_id: 2}")
        return cls(**data)

    @property
    def any(self) -> bool:
        return self.bos_token_id is not None or bool(self.eos_token_id) or self.pad_token_id is not None

    def validate(self, where: str = "model.special_tokens") -> "SpecialTokens":
        """Each id a whole number 0 or more. Not bounded by the vocabulary: nothing computes with
        them, and transformers keeps whatever a config.json says (an export writes it back)."""
        for name, ids in (("bos_token_id", (self.bos_token_id,)), ("eos_token_id", self.eos_token_id),
                          ("pad_token_id", (self.pad_token_id,))):
            for token in ids:
                if token is None:
                    continue
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise ConfigError(f"{where}.{name}", token, "is not a token id (a whole number 0 or more)",
                                      "set it to the tokenizer's id for that token, or remove it")
        return self

    def hf_fields(self) -> dict:
        """config.json's and generation_config.json's fields: eos as transformers writes it (an int,
        or a list where there are several); ids not known are left out, not written as null, so a
        class's own default is not overwritten with nothing."""
        found = {}
        if self.bos_token_id is not None:
            found["bos_token_id"] = self.bos_token_id
        if self.eos_token_id:
            found["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        if self.pad_token_id is not None:
            found["pad_token_id"] = self.pad_token_id
        return found

