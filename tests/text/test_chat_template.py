"""Request chat templates render as transformers renders them, within a time and size budget."""

from __future__ import annotations

import time
from typing import Any

import pytest

from flowllm.text.chat_template import (
    ChatTemplateError,
    TemplateBudget,
    render_chat,
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": 'Hello <b>there</b> & "you"'},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "How are you?"},
]

# Templates exercising transformers' environment: trim_blocks/lstrip_blocks, tojson,
# namespace, loop controls, raise_exception, special tokens as variables, macros, loop.*.
TEMPLATES = [
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{{ bos_token }}{% for m in messages %}{{ m | tojson }}{% if not loop.last %},{% endif %}"
    "{% endfor %}{{ eos_token }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'user' %}"
    "{% set ns.n = ns.n + 1 %}{% endif %}{% endfor %}users={{ ns.n }}",
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{{ m.role|upper ~ ': ' ~ m.content|trim }}\n{% if loop.index > 2 %}{% break %}{% endif %}"
    "{% endfor %}",
    "{% macro turn(m) %}[{{ m.role }}]{{ m.content }}{% endmacro %}"
    "{% for m in messages|reverse %}{{ turn(m) }}{% endfor %}"
    "{{ '%s-%d' % ('x', 3) }}{{ '{}:{}'.format('a', 1) }}{{ 'ab' * 3 }}{{ 2 ** 10 }}"
    "{{ messages|map(attribute='role')|join(',') }}{{ range(3)|list }}",
    "{% for m in messages %}\n  {%- if m.role == 'user' %}\n    U: {{ m.content }}\n"
    "  {%- endif %}\n{% endfor %}",
]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_budgeted_rendering_matches_transformers(
    gpt2_tokenizer: Any, template: str, add_generation_prompt: bool
) -> None:
    expected = gpt2_tokenizer.apply_chat_template(
        MESSAGES,
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        custom="ignored",
    )
    got = render_chat(
        gpt2_tokenizer,
        MESSAGES,
        template=template,
        add_generation_prompt=add_generation_prompt,
        template_kwargs={"custom": "ignored"},
        budget=TemplateBudget(),
    )
    assert got == expected


def test_template_kwargs_reach_the_template(gpt2_tokenizer: Any) -> None:
    template = "{% if enable_thinking %}<think>{% endif %}{{ messages[0].content }}{{ suffix }}"
    for budget in (None, TemplateBudget()):
        text = render_chat(
            gpt2_tokenizer,
            MESSAGES[:1],
            template=template,
            add_generation_prompt=True,
            template_kwargs={"enable_thinking": True, "suffix": "!"},
            budget=budget,
        )
        assert text == "<think>Be brief.!"


def test_reserved_template_kwargs_are_refused(gpt2_tokenizer: Any) -> None:
    with pytest.raises(ChatTemplateError) as info:
        render_chat(
            gpt2_tokenizer,
            MESSAGES,
            template="x",
            add_generation_prompt=True,
            template_kwargs={"messages": []},
        )
    assert info.value.param == "chat_template_kwargs"


@pytest.mark.parametrize(
    ("template", "param"),
    [
        ("{% for %}", "chat_template"),
        ("{{ raise_exception('no system role') }}", "chat_template"),
        ("{{ a.b.c }}", "chat_template"),
        ("{{ 1 + 'a' }}", "chat_template"),
        ("{{ 1 / 0 }}", "chat_template"),
        ("{{ messages[5].content }}", "chat_template"),
        ("{{ ''.__class__.__mro__ }}", "chat_template"),  # the sandbox still holds
        ("{{ messages.append(1) }}", "chat_template"),  # immutable sandbox
    ],
)
def test_template_failures_are_chat_template_errors(
    gpt2_tokenizer: Any, template: str, param: str
) -> None:
    with pytest.raises(ChatTemplateError) as info:
        render_chat(
            gpt2_tokenizer, MESSAGES, template=template, add_generation_prompt=True,
            budget=TemplateBudget(),
        )  # fmt: skip
    assert info.value.param == param
    assert len(info.value.message) < 400


def test_the_servers_template_refusing_the_messages_names_messages(gpt2_tokenizer: Any) -> None:
    template = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError) as failed:
        render_chat(
            gpt2_tokenizer, MESSAGES[1:], template=template, add_generation_prompt=True
        )
    assert failed.value.param == "messages"
    assert "system first" in failed.value.message


# Each of these would run for minutes, or allocate gigabytes, without the budget.
SLOW_TEMPLATES = {
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}"
    "{% endfor %}{% endfor %}",
    "nested ranges with output": "{% for i in range(100000) %}{% for j in range(100000) %}"
    "x{% endfor %}{% endfor %}",
    "nested list loops": "{% set l = range(100000)|list %}{% for a in l %}{% for b in l %}"
    "{% endfor %}{% endfor %}",
    "recursive macro": "{% macro f(n) %}{{ f(n) }}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "string doubling": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "string doubling with +": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "repetition": "{{ 'x' * 1000000000 }}",
    "huge power": "{{ 7 ** 1000000000 }}",
    "huge width": "{{ 'x'.ljust(1000000000) }}",
    "huge filter width": "{{ 'x'|center(1000000000) }}",
    "huge format width": "{{ '%1000000000d' % 1 }}",
    "huge str.format width": "{{ '{:>1000000000}'.format(1) }}",
    "lipsum": "{{ lipsum(100000) }}",
}


@pytest.mark.parametrize("name", list(SLOW_TEMPLATES))
def test_the_budget_stops_expensive_templates_quickly(gpt2_tokenizer: Any, name: str) -> None:
    started = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        render_chat(
            gpt2_tokenizer,
            MESSAGES,
            template=SLOW_TEMPLATES[name],
            add_generation_prompt=True,
            budget=TemplateBudget(seconds=0.5, max_chars=100_000),
        )
    elapsed = time.monotonic() - started
    assert info.value.param == "chat_template"
    assert elapsed < 3.0, f"{name} took {elapsed:.1f} s"


def test_output_budget(gpt2_tokenizer: Any) -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    big = [{"role": "user", "content": "y" * 5000}] * 3
    budget = TemplateBudget(seconds=5, max_chars=10_000)
    with pytest.raises(ChatTemplateError) as info:
        render_chat(
            gpt2_tokenizer, big, template=template, add_generation_prompt=True, budget=budget
        )
    assert info.value.code == "template_budget_exceeded"
    ok = render_chat(
        gpt2_tokenizer, big[:2], template=template, add_generation_prompt=True, budget=budget
    )
    assert len(ok) == 10_000
