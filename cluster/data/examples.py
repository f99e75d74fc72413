"""The examples of an SFT input file (`data prepare --format sft`): a JSONL line or a Parquet row
holds either a prompt and a completion (two text fields), or a conversation (a list of
{role, content} messages) that the tokenizer's chat template renders. Bad rows raise
DataInputError naming the file and row (under --skip-bad they are counted instead).

A preference row (`--format preference`) holds a prompt and two responses, chosen and rejected
(text fields); the prompt may instead be a list of messages, rendered with the chat template and
its generation prompt. It becomes two examples of the same prompt, read as one (a `PreferencePair`).

A conversation trains on its last message, which must be the assistant's: the prompt is the
template's rendering of the messages before it with the generation prompt, the completion what the
full rendering adds after that prompt (the assistant's text and the template's end-of-turn).
"""
from __future__ import annotations

import io
import json
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from rayshard.cluster.data.chat_template_environment import compiled_chat_template
from rayshard.cluster.data.documents import JSONL_SUFFIXES, PARQUET_SUFFIXES, ReadOptions, _first_line, _utf8, read_input_file
from rayshard.plans.data.errors import DataInputError


@dataclass(frozen=True)
class Example:
    source: str
    row: int  # the JSONL line or Parquet row, from 1
    prompt: str
    completion: str


@dataclass(frozen=True)
class PreferencePair:
    """One preference row: the chosen and the rejected example, the same prompt in both."""

    chosen: Example
    rejected: Example

    @property
    def examples(self) -> tuple[Example, Example]:
        return self.chosen, self.rejected


@dataclass(frozen=True)
class ChatTemplate:
    """A tokenizer's chat template (tokenizer_config.json's chat_template) and the special tokens
    templates refer to."""

    source: str
    template: str | None
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return compiled_chat_template(self.template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                            bos_token=self.bos_token, eos_token=self.eos_token)


def chat_template_of(config_json: str | None, source: str) -> ChatTemplate:
    config = json.loads(config_json) if config_json else {}
    token = lambda value: value.get("content", "") if isinstance(value, dict) else (value or "")  # noqa: E731
    template = config.get("chat_template")
    return ChatTemplate(source, template if isinstance(template, str) else None,
                        token(config.get("bos_token")), token(config.get("eos_token")))


def read_examples(url: str, options: ReadOptions, chat: ChatTemplate,
                  skipped: list[str]) -> Iterator[Example | PreferencePair]:
    """The file's examples (--format sft) or preference pairs (--format preference); under
    options.skip_bad a bad row (or file) is described in `skipped`."""
    parse = _pair if options.format == "preference" else _example
    try:
        data = read_input_file(url)
        lower = url.lower()
        if lower.endswith(PARQUET_SUFFIXES):
            rows = _parquet_rows(url, data)
        elif lower.endswith(JSONL_SUFFIXES):
            rows = _jsonl_rows(url, data)
        else:
            raise DataInputError(url, None, f"--format {options.format} reads JSONL (.jsonl) or Parquet (.parquet) files",
                                 "convert it, or pass --format text")
        for number, record in rows:
            try:
                if isinstance(record, DataInputError):
                    raise record
                yield parse(url, number, record, options, chat)
            except DataInputError as error:
                if not options.skip_bad:
                    raise
                skipped.append(str(error))
    except DataInputError as error:
        if not options.skip_bad:
            raise
        skipped.append(str(error))


def _jsonl_rows(url: str, data: bytes) -> Iterator[tuple[int, dict | DataInputError]]:
    for number, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(_utf8(url, line, number))
        except json.JSONDecodeError as error:
            yield number, DataInputError(url, number, f"not JSON ({error.msg})", "fix the line, or pass --skip-bad")
            continue
        except DataInputError as error:
            yield number, error
            continue
        yield number, record if isinstance(record, dict) else DataInputError(
            url, number, f"a JSON {type(record).__name__}, not an object", "fix the line, or pass --skip-bad")


def _parquet_rows(url: str, data: bytes) -> Iterator[tuple[int, dict]]:
    try:
        table = pq.read_table(io.BytesIO(data))
    except (pa.ArrowException, OSError) as error:
        raise DataInputError(url, None, f"not a readable Parquet file ({_first_line(error)})",
                             "write it again, or pass --skip-bad to leave it out") from None
    yield from enumerate(table.to_pylist(), start=1)


def _example(url: str, row: int, record: dict, options: ReadOptions, chat: ChatTemplate) -> Example:
    prompt_field, completion_field, messages_field = options.prompt_field, options.completion_field, options.messages_field
    if record.get(prompt_field) is not None or record.get(completion_field) is not None:
        prompt, completion = record.get(prompt_field), record.get(completion_field)
        for name, value in ((prompt_field, prompt), (completion_field, completion)):
            if not isinstance(value, str):
                raise DataInputError(url, row, f"field {name!r} holds {type(value).__name__}, not text",
                                     f"give every row text {prompt_field!r} and {completion_field!r} fields, or pass --skip-bad")
    elif record.get(messages_field) is not None:
        prompt, completion = _rendered(url, row, record[messages_field], messages_field, chat)
    else:
        raise DataInputError(url, row, f"neither {prompt_field!r} and {completion_field!r} nor {messages_field!r} "
                             f"(fields: {sorted(record)})",
                             "pass --prompt-field/--completion-field or --messages-field naming them, or --skip-bad")
    if not completion:
        raise DataInputError(url, row, "an empty completion (nothing to train on)", "fill it, or pass --skip-bad")
    return Example(url, row, prompt, completion)


def _pair(url: str, row: int, record: dict, options: ReadOptions, chat: ChatTemplate) -> PreferencePair:
    names = (options.prompt_field, options.chosen_field, options.rejected_field)
    missing = [name for name in names if record.get(name) is None]
    if missing:
        raise DataInputError(url, row, f"no {', '.join(map(repr, missing))} field (fields: {sorted(record)})",
                             "pass --prompt-field/--chosen-field/--rejected-field naming them, or --skip-bad")
    prompt = record[options.prompt_field]
    if isinstance(prompt, list):  # a conversation to answer: the template's rendering with the generation prompt
        _check_template(url, row, options.prompt_field, chat)
        _check_messages(url, row, prompt, options.prompt_field)
        prompt = _render(url, row, chat, [{"role": m["role"], "content": m["content"]} for m in prompt], True)
    for name in names:
        value = prompt if name == options.prompt_field else record[name]
        if not isinstance(value, str):
            raise DataInputError(url, row, f"field {name!r} holds {type(value).__name__}, not text",
                                 f"give every row text {', '.join(map(repr, names))} fields, or pass --skip-bad")
    for name in names[1:]:
        if not record[name]:
            raise DataInputError(url, row, f"an empty {name!r} response (a pair needs both responses)",
                                 "fill it, or pass --skip-bad")
    return PreferencePair(Example(url, row, prompt, record[options.chosen_field]),
                          Example(url, row, prompt, record[options.rejected_field]))


def _check_template(url: str, row: int, field: str, chat: ChatTemplate) -> None:
    if chat.template is None:
        raise DataInputError(url, row, f"{field!r} needs a chat template; tokenizer {chat.source} has none "
                             "(no chat_template in its tokenizer_config.json)",
                             "pass a --tokenizer with a chat template, or text prompts")


def _check_messages(url: str, row: int, messages, field: str) -> None:
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise DataInputError(url, row, f"{field!r} is not a list of {{role, content}} messages with text content",
                             "fix the row, or pass --skip-bad")


def _render(url: str, row: int, chat: ChatTemplate, messages: list[dict], add_generation_prompt: bool) -> str:
    try:
        return chat.render(messages, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # noqa: BLE001 - a template's own error (raise_exception, bad syntax) names the row
        raise DataInputError(url, row, f"the chat template failed: {type(error).__name__}: {_first_line(error)}",
                             "fix the row or the template, or pass --skip-bad") from None


def _rendered(url: str, row: int, messages, field: str, chat: ChatTemplate) -> tuple[str, str]:
    _check_template(url, row, field, chat)
    _check_messages(url, row, messages, field)
    if messages[-1]["role"] != "assistant":
        raise DataInputError(url, row, f"the last message's role is {messages[-1]['role']!r}, not 'assistant' "
                             "(the completion trained on is the last assistant message)", "fix the row, or pass --skip-bad")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    prompt = _render(url, row, chat, messages[:-1], True)
    whole = _render(url, row, chat, messages, False)
    if not whole.startswith(prompt):
        raise DataInputError(url, row, "the chat template's rendering of the conversation does not begin with its "
                             "rendering of the prompt, so the completion cannot be cut off it",
                             "use a template whose turns only append, or prompt/completion fields")
    return prompt, whole[len(prompt):]
