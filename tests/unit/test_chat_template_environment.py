"""Chat templates render here as transformers' `apply_chat_template` renders them (decision 156):
the same text for templates that use what its Jinja environment adds (loop controls, tojson's
keyword arguments, strftime_now, the generation block, namespace and dict), and the same refusals."""
from __future__ import annotations

import pytest
from jinja2.exceptions import SecurityError, TemplateError
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rayshard.cluster.data.examples import ChatTemplate

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo <b>"},
            {"role": "assistant", "content": "hi"}]
END = "{% if add_generation_prompt %}<|assistant|>{% endif %}"
TEMPLATES = {
    "loop controls": "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}<|{{ m.role }}|>"
                     "{{ m.content }}</s>{% if m.role == 'assistant' %}{% break %}{% endif %}{% endfor %}" + END,
    "tojson keywords": "{% for m in messages %}{{ m | tojson(sort_keys=True, separators=(',', ':')) }}{% endfor %}" + END,
    "tojson indent": "{{ messages[0] | tojson(indent=2) }}" + END,
    "strftime_now": "Today Date: {{ strftime_now('%d %b %Y') }}\n{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                    "{% endfor %}" + END,
    "generation block": "{% for m in messages %}{% if m.role == 'assistant' %}<|assistant|>{% generation %}{{ m.content }}"
                        "</s>{% endgeneration %}{% else %}<|{{ m.role }}|>{{ m.content }}</s>{% endif %}{% endfor %}" + END,
    "namespace and dict": "{% set ns = namespace(count=0) %}{% for m in messages %}{% set ns.count = ns.count + 1 %}"
                          "{% endfor %}{{ ns.count }}{{ dict(a=1) | tojson }}{{ bos_token }}{{ eos_token }}" + END,
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    raw = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_a_template_renders_as_transformers_renders_it(hf_tokenizer, name, add_generation_prompt):
    template = TEMPLATES[name]
    theirs = hf_tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    ours = ChatTemplate("t", template, "<s>", "</s>").render(MESSAGES, add_generation_prompt=add_generation_prompt)
    assert ours == theirs


@pytest.mark.parametrize("template, error", [
    ("{{ raise_exception('no system role') }}", TemplateError),
    ("{% set ns = namespace(_secret=1) %}", SecurityError),
    ("{{ messages.__class__ }}{{ ''.__class__.__mro__ }}", SecurityError),
])
def test_what_transformers_refuses_is_refused(hf_tokenizer, template, error):
    with pytest.raises(error):
        hf_tokenizer.apply_chat_template(MESSAGES, chat_template=template, tokenize=False)
    with pytest.raises(error):
        ChatTemplate("t", template, "<s>", "</s>").render(MESSAGES, add_generation_prompt=False)
