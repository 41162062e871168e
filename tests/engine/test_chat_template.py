"""A chat template that fails to render is the client's 400, naming what was at fault."""

from __future__ import annotations

from typing import Any

import pytest

from flowllm.engine.chat_template import PromptError, render_chat

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "template",
    [
        '{{ raise_exception("no") }}',
        "{{ a.b.c }}",
        "{{ 1 + 'a' }}",
        "{{ 1 / 0 }}",
        "{% for %}",
        "{{ messages[5].content }}",
    ],
)
def test_a_failing_template_names_chat_template(gpt2_tokenizer: Any, template: str) -> None:
    with pytest.raises(PromptError) as failed:
        render_chat(
            gpt2_tokenizer,
            MESSAGES,
            template=template,
            add_generation_prompt=True,
            template_given=True,
        )
    assert failed.value.param == "chat_template"
    assert len(str(failed.value)) < 400


def test_the_servers_template_refusing_the_messages_names_messages(gpt2_tokenizer: Any) -> None:
    template = (
        "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}"
    )
    with pytest.raises(PromptError) as failed:
        render_chat(
            gpt2_tokenizer,
            MESSAGES,
            template=template,
            add_generation_prompt=True,
            template_given=False,
        )
    assert failed.value.param == "messages"
    assert "system first" in str(failed.value)


def test_a_working_template_renders(gpt2_tokenizer: Any) -> None:
    text = render_chat(
        gpt2_tokenizer,
        MESSAGES,
        template="{% for m in messages %}{{ m.role }}: {{ m.content }}{% endfor %}",
        add_generation_prompt=False,
        template_given=True,
    )
    assert text == "user: hi"
