"""POST /v1/chat/completions against the fake engine."""

from __future__ import annotations

import time
from typing import Any

import pytest
from api_fake_engine import (
    CHAT_TEMPLATE,
    MODEL,
    FakeEngine,
    expected_tokens,
    gen_logprob,
    make_app,
    sse_events,
)
from litestar.testing import AsyncTestClient

from flowllm.text.chat_template import TemplateBudget

pytestmark = pytest.mark.anyio

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a colour."},
]


def rendered_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """The prompt the template gives, rendered by transformers independently of the API."""
    text = tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


async def test_chat_response_shape(client: AsyncTestClient, tokenizer: Any) -> None:
    r = await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("chatcmpl-")
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert set(choice) == {"index", "message", "logprobs", "finish_reason", "stop_reason"}
    ids = rendered_ids(tokenizer, MESSAGES)
    assert choice["message"] == {
        "role": "assistant",
        "content": tokenizer.decode(expected_tokens(ids, 3, 0)),
    }
    assert choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 3,
        "total_tokens": len(ids) + 3,
    }


async def test_chat_request_reaches_the_graph(client: AsyncTestClient, engine: FakeEngine) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more", "name": "bob"},
    ]
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": messages, "max_completion_tokens": 2, "add_generation_prompt": False},
    )
    assert r.status_code == 200, r.text
    sent = engine.submitted[0]
    assert [(m.role, m.content) for m in sent.messages or ()] == [
        ("user", "a\nb"),
        ("assistant", "ok"),
        ("user", "more"),
    ]
    assert sent.params.max_tokens == 2
    assert sent.add_generation_prompt is False
    assert sent.chat_template == CHAT_TEMPLATE  # the server's --chat-template text
    assert sent.prompt is None and sent.prompt_token_ids is None


async def test_chat_max_tokens_defaults_to_the_rest_of_the_context(
    client: AsyncTestClient, engine: FakeEngine, tokenizer: Any
) -> None:
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert engine.submitted[0].params.max_tokens is None
    usage = r.json()["usage"]
    assert usage["total_tokens"] == engine.max_model_len


async def test_request_chat_template_wins_when_trusted(engine: FakeEngine) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{{ sep }}{% endfor %}"
    body = {
        "messages": MESSAGES,
        "max_tokens": 1,
        "chat_template": template,
        "chat_template_kwargs": {"sep": "|"},
    }
    async with AsyncTestClient(make_app(engine, trust_request_chat_template=True)) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert engine.submitted[0].chat_template == template
    assert engine.submitted[0].chat_template_kwargs == {"sep": "|"}


@pytest.mark.parametrize("param", ["chat_template", "chat_template_kwargs"])
async def test_request_chat_template_is_refused_unless_trusted(
    client: AsyncTestClient, engine: FakeEngine, param: str
) -> None:
    value = "{{ messages }}" if param == "chat_template" else {"enable_thinking": True}
    r = await client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, param: value}
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == (param, "untrusted_chat_template")
    assert "--trust-request-chat-template" in error["message"]
    assert engine.submitted == []


async def test_slow_request_template_is_a_quick_400(engine: FakeEngine) -> None:
    template = (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    )
    budget = TemplateBudget(seconds=0.3)
    engine.template_budget = budget  # the fake graph's tokenize
    app = make_app(engine, trust_request_chat_template=True, template_budget=budget)
    body = {"messages": MESSAGES, "chat_template": template}
    async with AsyncTestClient(app) as client:
        for path in ("/v1/chat/completions", "/tokenize"):
            started = time.monotonic()
            r = await client.post(path, json=body)
            assert time.monotonic() - started < 5
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert (error["param"], error["code"]) == ("chat_template", "template_budget_exceeded")


async def test_no_chat_template_is_a_clear_400(engine: FakeEngine) -> None:
    async with AsyncTestClient(make_app(engine, chat_template=None)) as client:
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 400
    assert "chat template" in r.json()["error"]["message"]


async def test_chat_logprobs(client: AsyncTestClient, tokenizer: Any) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 2},
    )
    choice = r.json()["choices"][0]
    gen = expected_tokens(rendered_ids(tokenizer, MESSAGES), 2, 0)
    content = choice["logprobs"]["content"]
    assert len(content) == 2
    for k, item in enumerate(content):
        token = tokenizer.decode([gen[k]])
        assert item["token"] == token
        assert item["logprob"] == gen_logprob(k, 0)
        assert item["bytes"] == list(token.encode())
        assert [t["token"] for t in item["top_logprobs"]] == [
            token,
            tokenizer.decode([gen[k] + 1]),
        ]
        assert item["top_logprobs"][1]["logprob"] == gen_logprob(k, 0) - 1
    # logprobs without top_logprobs: the chosen token only.
    r = await client.post(
        "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "logprobs": True}
    )
    assert r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


async def test_chat_streaming(client: AsyncTestClient, tokenizer: Any) -> None:
    whole = (
        await client.post(
            "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "n": 2}
        )
    ).json()
    r = await client.post(
        "/v1/chat/completions",
        json={
            "messages": MESSAGES,
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    events = sse_events(r.text)
    *chunks, final = events
    seen_role: set[int] = set()
    content: dict[int, str] = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for event in chunks:
        assert event["object"] == "chat.completion.chunk"
        assert event["id"].startswith("chatcmpl-") and event["usage"] is None
        (choice,) = event["choices"]
        i = choice["index"]
        if i not in seen_role:
            # The first chunk of every choice carries the role.
            assert choice["delta"]["role"] == "assistant"
            seen_role.add(i)
        else:
            assert "role" not in choice["delta"]
        content[i] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            finish[i] = choice["finish_reason"]
    for choice in whole["choices"]:
        assert content[choice["index"]] == choice["message"]["content"]
        assert finish[choice["index"]] == choice["finish_reason"]
    assert final["choices"] == [] and final["usage"] == whole["usage"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
        ({"messages": [{"role": "robot", "content": "x"}]}, None),
        ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools"),
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
    ],
)
async def test_chat_errors(client: AsyncTestClient, body: Any, param: str | None) -> None:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param
    else:
        assert error["param"].startswith("messages[0]")


async def test_chat_range_error_while_streaming_keeps_its_status(
    client: AsyncTestClient,
) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "stream": True, "presence_penalty": 3},
    )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "presence_penalty"


async def test_chat_context_length(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, max_model_len=16)
    async with AsyncTestClient(make_app(engine)) as client:
        r = await client.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "maximum context length is 16 tokens" in error["message"]
