"""Text from an exported Hugging Face directory, the way a user of the export would get it:
`transformers`' AutoTokenizer and AutoModelForCausalLM, then `generate`. Nothing of rayshard's own
model code runs here, so a line of text proves the export stands on its own.
"""
from __future__ import annotations

import importlib
import os

from rayshard.plans.errors import RayshardError


def generate_text(directory: str, prompt: str, max_new_tokens: int = 24, seed: int = 0) -> str:
    """The prompt and a sampled continuation, decoded. Sampled (top-k, seeded: the same line for the
    same weights and seed) because a briefly trained model's greedy choice is a run of spaces."""
    tokenizer, ids = generate_ids(directory, prompt, max_new_tokens, seed)
    return tokenizer.decode(ids, skip_special_tokens=True)


def generate_ids(directory: str, prompt: str, max_new_tokens: int = 24, seed: int = 0):
    """(the tokenizer, the prompt's ids and the continuation's), the continuation ending at the
    first end-of-sequence id: generation_config.json's (written by the export), else the
    tokenizer's end-of-document token, so an export of before still stops there."""
    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise RayshardError(f"{directory}: no config.json. Fix: pass the --out of `rayshard ckpt export`")
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise RayshardError(f"{directory}: no tokenizer.json (the run trained on byte-level text, which has none). "
                            "Fix: export a run trained with --data on a prepared dataset")
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise RayshardError("generating text needs transformers. Fix: pip install transformers") from None
    transformers.utils.logging.disable_progress_bar()  # one line of text is the output
    transformers.set_seed(seed)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory)
    model.eval()
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=True, top_k=40, eos_token_id=eos,
                            pad_token_id=pad)
    return tokenizer, output[0].tolist()
