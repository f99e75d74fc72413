"""Tokenizers: Hugging Face `tokenizers` byte-level BPE trained on the user's text, or loaded from a
`tokenizer.json` or a Hugging Face model directory; saved so `AutoTokenizer.from_pretrained` loads it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import fsspec
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rayshard.cluster.data.documents import ReadOptions, input_files, read_documents
from rayshard.plans.errors import ConfigError, RayshardError
from rayshard.plans.training.special_tokens import SpecialTokens

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
END_OF_DOCUMENT = "<|endoftext|>"
# Names Hugging Face tokenizers give their end-of-document token when tokenizer_config.json says none.
EOS_CANDIDATES = (END_OF_DOCUMENT, "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>")
MIN_VOCAB = 257  # every byte, plus the end-of-document token


@dataclass(frozen=True)
class LoadedTokenizer:
    tokenizer: Tokenizer
    json_text: str
    eos_token: str
    eos_id: int
    source: str
    config_json: str | None = None  # the source's tokenizer_config.json, kept as it was

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def hash(self) -> str:
        return tokenizer_hash(self.json_text)


def tokenizer_hash(json_text: str) -> str:
    return hashlib.sha256(json_text.encode()).hexdigest()[:32]


def train_tokenizer(inputs: list[str], vocab_size: int, options: ReadOptions = ReadOptions(),
                    progress=None) -> LoadedTokenizer:
    """A byte-level BPE with END_OF_DOCUMENT as its only special token (id 0)."""
    if vocab_size < MIN_VOCAB:
        raise ConfigError("--vocab-size", vocab_size, f"a byte-level BPE needs at least {MIN_VOCAB} ids "
                          "(256 bytes and the end-of-document token)", f"pass --vocab-size {MIN_VOCAB} or more")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_DOCUMENT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    skipped: list[str] = []

    def texts():
        for url, _ in input_files(inputs, options.max_bytes):
            for document in read_documents(url, options, skipped):
                if progress is not None:
                    progress.update(len(document.text.encode()))
                yield document.text

    tokenizer.train_from_iterator(texts(), trainer)
    text = tokenizer.to_str()
    return LoadedTokenizer(tokenizer, text, END_OF_DOCUMENT, tokenizer.token_to_id(END_OF_DOCUMENT), "trained")


def save_tokenizer(loaded: LoadedTokenizer, directory: str) -> list[str]:
    """tokenizer.json and a tokenizer_config.json that transformers' AutoTokenizer understands."""
    fs, base = fsspec.core.url_to_fs(directory)
    fs.makedirs(base, exist_ok=True)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": loaded.eos_token,
              "bos_token": loaded.eos_token, "unk_token": loaded.eos_token,
              "clean_up_tokenization_spaces": False, "model_max_length": 1 << 30}
    fs.pipe_file(f"{base}/{TOKENIZER_JSON}", loaded.json_text.encode())
    fs.pipe_file(f"{base}/{TOKENIZER_CONFIG}", (loaded.config_json or json.dumps(config, indent=2)).encode())
    return [f"{directory.rstrip('/')}/{TOKENIZER_JSON}", f"{directory.rstrip('/')}/{TOKENIZER_CONFIG}"]


def load_tokenizer(path: str) -> LoadedTokenizer:
    """A tokenizer.json, or a directory holding one (a Hugging Face model directory, our --out)."""
    fs, base = fsspec.core.url_to_fs(path.rstrip("/"))
    json_path, config_path = base, None
    if fs.isdir(base):
        json_path, config_path = f"{base}/{TOKENIZER_JSON}", f"{base}/{TOKENIZER_CONFIG}"
    try:
        text = fs.cat_file(json_path).decode()
        tokenizer = Tokenizer.from_str(text)
    except FileNotFoundError:
        raise ConfigError("--tokenizer", path, f"no {TOKENIZER_JSON} there",
                          "pass a tokenizer.json, a Hugging Face model directory, or the --out of "
                          "`rayshard data tokenizer train`") from None
    except Exception as error:  # tokenizers raises plain Exception for a malformed file
        raise ConfigError("--tokenizer", path, f"not a Hugging Face tokenizer.json ({str(error).splitlines()[0][:200]})",
                          "pass a tokenizer.json that `tokenizers.Tokenizer.from_file` loads") from None
    configured, config_json = None, None
    if config_path is not None and fs.exists(config_path):
        config_json = fs.cat_file(config_path).decode()
        try:
            settings = json.loads(config_json)
        except ValueError as error:
            raise ConfigError("--tokenizer", path, f"its {TOKENIZER_CONFIG} is not valid JSON ({error})",
                              f"restore {TOKENIZER_CONFIG}, or remove it to use tokenizer.json alone") from None
        if not isinstance(settings, dict):
            raise ConfigError("--tokenizer", path, f"its {TOKENIZER_CONFIG} holds a JSON {type(settings).__name__}, not an "
                              "object", f"restore {TOKENIZER_CONFIG}, or remove it to use tokenizer.json alone")
        eos = settings.get("eos_token")
        configured = eos.get("content") if isinstance(eos, dict) else eos
        configured = configured if isinstance(configured, str) else None
    for candidate in ([configured] if configured else []) + list(EOS_CANDIDATES):
        token_id = tokenizer.token_to_id(candidate)
        if token_id is not None:
            return LoadedTokenizer(tokenizer, text, candidate, token_id, path, config_json)
    raise RayshardError(f"{path}: the tokenizer has no end-of-document token (looked for {[configured] if configured else []}"
                        f"{list(EOS_CANDIDATES)}). Fix: set eos_token in {TOKENIZER_CONFIG}, or train one with "
                        "`rayshard data tokenizer train`")


def copy_tokenizer_files(source_dir: str, target_dir: str) -> list[str]:
    """tokenizer.json and tokenizer_config.json (where present) from one directory URL to another."""
    source_fs, source = fsspec.core.url_to_fs(source_dir.rstrip("/"))
    target_fs, target = fsspec.core.url_to_fs(target_dir.rstrip("/"))
    copied = []
    for name in (TOKENIZER_JSON, TOKENIZER_CONFIG):
        if source_fs.exists(f"{source}/{name}"):
            target_fs.makedirs(target, exist_ok=True)
            target_fs.pipe_file(f"{target}/{name}", source_fs.cat_file(f"{source}/{name}"))
            copied.append(name)
    return copied


def tokenizer_url_of(metadata: dict) -> str | None:
    """The tokenizer a checkpoint's run used: its prepared dataset's, or the one `ckpt import` kept."""
    dataset = (metadata.get("data_position") or {}).get("dataset") or {}
    return dataset.get("tokenizer_url") or metadata.get("tokenizer_url")


def special_tokens_of(loaded: LoadedTokenizer) -> SpecialTokens:
    """The ids a tokenizer names: its end-of-document token as eos, and bos and pad where its
    tokenizer_config.json names tokens the vocabulary holds (ours names bos as the eos token, as
    GPT-2's does)."""
    config = json.loads(loaded.config_json) if loaded.config_json else {}

    def named(key: str) -> int | None:
        token = config.get(key) if isinstance(config, dict) else None
        token = token.get("content") if isinstance(token, dict) else token
        return loaded.tokenizer.token_to_id(token) if isinstance(token, str) else None

    return SpecialTokens(bos_token_id=named("bos_token"), eos_token_id=loaded.eos_id, pad_token_id=named("pad_token"))
