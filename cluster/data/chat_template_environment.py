"""The Jinja environment a chat template renders in, as transformers' `apply_chat_template` builds
it (transformers/utils/chat_template_utils.py, `_compile_jinja_template`), so a template renders
here exactly as there (decision 156): the sandbox with trim_blocks and lstrip_blocks; the
`loopcontrols` extension (`{% break %}`, `{% continue %}`); the `{% generation %}` block that
marks assistant text (rendered as its body: transformers only tracks where it falls, for
`return_assistant_tokens_mask`); `tojson` with its keyword arguments (sort_keys, indent,
separators, ensure_ascii) and without Jinja's HTML escaping; the globals `raise_exception`,
`strftime_now` (the date as the rendering machine's clock reads it, as Llama 3.x templates ask),
`dict` and `namespace` (refusing underscore names, as transformers does).

transformers is not a runtime dependency of rayshard, so its environment is restated here;
tests/unit/test_chat_template_environment.py renders templates through both and compares.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the assistant's part of a template, rendered as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without the class itself (no attribute access to its type)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace refusing underscore-prefixed names (no reach into CPython internals)."""

    def __init__(*args, **kwargs):  # Jinja's own signature trick: `namespace(self=...)` still works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})")


@lru_cache(maxsize=8)
def compiled_chat_template(template: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                               namespace=_TemplateNamespace)
    return environment.from_string(template)
