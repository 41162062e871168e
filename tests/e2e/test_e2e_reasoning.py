"""Reasoning output through a real server and the openai SDK: a Qwen3 that thinks by
script (model_fixtures.THINKING_MODEL), `--reasoning-parser qwen3`, thinking off by
`--default-chat-template-kwargs` and back on by a request's `chat_template_kwargs`;
structured output after the thinking part; chat `echo` and `prompt_logprobs`;
`continuous_usage_stats` on both endpoints.

The expected splits are the script's, by hand: thinking on, the model generates
`<think> I think</think>\\n\\n Yes.` then EOS (8 tokens), so `reasoning_content` is
" I think" and `content` "\\n\\n Yes."; thinking off, it generates " Yes." and EOS.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from e2e_helpers import assert_error
from server_process import ServerProcess

QUESTION = [{"role": "user", "content": "Is it?"}]
THINKING_ON = {"chat_template_kwargs": {"enable_thinking": True}}


def reasoning_of(message: Any) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")  # type: ignore[no-any-return]


def chat(server: ServerProcess, max_tokens: int = 16, **kwargs: Any) -> Any:
    return server.client().chat.completions.create(
        model=server.model, messages=QUESTION, temperature=0, max_tokens=max_tokens, **kwargs
    )


def test_thinking_off_by_the_servers_default(reasoning_server: ServerProcess) -> None:
    out = chat(reasoning_server)
    message = out.choices[0].message
    assert (message.content, reasoning_of(message)) == (" Yes.", None)
    assert out.choices[0].finish_reason == "stop"
    assert out.usage is not None and out.usage.completion_tokens == 3  # " Yes", ".", EOS


def test_thinking_on_whole_and_streamed(reasoning_server: ServerProcess) -> None:
    whole = chat(reasoning_server, extra_body=THINKING_ON)
    message = whole.choices[0].message
    assert (reasoning_of(message), message.content) == (" I think", "\n\n Yes.")
    assert whole.usage is not None and whole.usage.completion_tokens == 8  # thinking counts
    options = {"include_usage": True, "continuous_usage_stats": True}
    stream = chat(
        reasoning_server, stream=True, extra_body={**THINKING_ON, "stream_options": options}
    )
    thinking, content, so_far, usage = [], [], 0, None
    for chunk in stream:
        assert chunk.usage is not None  # continuous usage: on every chunk
        if not chunk.choices:
            usage = chunk.usage
            continue
        assert chunk.usage.prompt_tokens == whole.usage.prompt_tokens
        assert chunk.usage.completion_tokens >= so_far
        so_far = chunk.usage.completion_tokens
        delta = chunk.choices[0].delta
        thinking.append(reasoning_of(delta) or "")
        content.append(delta.content or "")
    assert ("".join(thinking), "".join(content)) == (" I think", "\n\n Yes.")
    assert all("think>" not in piece for piece in thinking + content)
    assert so_far == 8 and usage == whole.usage


def test_structured_output_applies_to_the_answer(reasoning_server: ServerProcess) -> None:
    """The constraint would forbid <think> as the first token and the model's own answer
    ("\\n\\n Yes."): the thinking part stays free and the answer is the constraint's."""
    regex = chat(
        reasoning_server, extra_body={**THINKING_ON, "structured_outputs": {"regex": " No!"}}
    )
    message = regex.choices[0].message
    assert (reasoning_of(message), message.content) == (" I think", " No!")
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    out = chat(
        reasoning_server,
        extra_body=THINKING_ON,
        max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    message = out.choices[0].message
    assert reasoning_of(message) == " I think"
    jsonschema.validate(json.loads(message.content or ""), schema)


def test_chat_echo_and_prompt_logprobs(reasoning_server: ServerProcess) -> None:
    """echo opens the continued assistant message's answer with its content; the chat's
    prompt_logprobs are the completion's of the same prompt ids (the chat's rendering, the
    server's default kwargs included, from /tokenize)."""
    messages = [*QUESTION, {"role": "assistant", "content": "Well,"}]
    out = reasoning_server.client().chat.completions.create(
        model=reasoning_server.model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=2,
        temperature=0,
        extra_body={"echo": True, "add_generation_prompt": False, "prompt_logprobs": 1},
    )
    message = out.choices[0].message
    assert message.role == "assistant" and (message.content or "").startswith("Well,")
    tokenized = httpx.post(reasoning_server.url + "/tokenize", json={"messages": QUESTION})
    ids = tokenized.json()["tokens"]
    assert tokenized.json()["count"] == len(ids)
    chat_entries = chat(reasoning_server, max_tokens=1, extra_body={"prompt_logprobs": 1})
    completion = reasoning_server.client().completions.create(
        model=reasoning_server.model,
        prompt=ids,
        max_tokens=1,
        temperature=0,
        extra_body={"prompt_logprobs": 1},
    )
    entries = (chat_entries.model_extra or {})["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    assert entries == (completion.choices[0].model_extra or {})["prompt_logprobs"]


def test_completions_continuous_usage_stats(reasoning_server: ServerProcess) -> None:
    client = reasoning_server.client()
    stream = client.completions.create(
        model=reasoning_server.model,
        prompt=["a\n", "b\n\n"],
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"stream_options": {"continuous_usage_stats": True}},
    )
    last: dict[int, Any] = {}
    for chunk in stream:
        assert chunk.usage is not None and len(chunk.choices) == 1
        last[chunk.choices[0].index] = chunk.usage
    assert {i: u.prompt_tokens for i, u in last.items()} == {0: 2, 1: 2}
    # "\n" starts the thinking script (4 tokens at most); "\n\n" answers " Yes." then EOS
    assert {i: u.completion_tokens for i, u in last.items()} == {0: 4, 1: 3}
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in last.values())


@pytest.mark.parametrize(
    "kwargs",
    [{"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {}}}}}}}}}, {"tools": []}],
)
def test_bad_template_kwargs_are_400s(reasoning_server: ServerProcess, kwargs: Any) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(reasoning_server, extra_body={"chat_template_kwargs": kwargs})
    assert raised.value.param == "chat_template_kwargs"
    r = httpx.post(
        reasoning_server.url + "/v1/chat/completions",
        json={"messages": QUESTION, "chat_template_kwargs": kwargs},
    )
    assert_error(r, 400)
