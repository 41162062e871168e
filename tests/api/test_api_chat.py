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
    prompt_logprob,
    sse_events,
)
from litestar.testing import AsyncTestClient
from model_fixtures import QWEN3_STYLE_TEMPLATE

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


async def test_request_chat_template_is_refused_unless_trusted(
    client: AsyncTestClient, engine: FakeEngine
) -> None:
    r = await client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 1, "chat_template": "{{ messages }}"},
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["param"], error["code"]) == ("chat_template", "untrusted_chat_template")
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


# -- chat_template_kwargs ----------------------------------------------------------------

async def test_template_kwargs_from_any_client_over_the_servers_defaults(
    engine: FakeEngine, tokenizer: Any
) -> None:
    """`enable_thinking: false` as the server's default (--default-chat-template-kwargs),
    and a request's own overriding it, without --trust-request-chat-template."""
    app = make_app(
        engine,
        chat_template=QWEN3_STYLE_TEMPLATE,
        default_chat_template_kwargs={"enable_thinking": False},
    )

    def oracle(enable_thinking: bool) -> str:  # transformers' own rendering
        return str(
            tokenizer.apply_chat_template(
                MESSAGES,
                chat_template=QWEN3_STYLE_TEMPLATE,
                add_generation_prompt=True,
                tokenize=False,
                enable_thinking=enable_thinking,
            )
        )

    async with AsyncTestClient(app) as client:

        async def rendered(kwargs: dict[str, Any] | None) -> str:
            body: dict[str, Any] = {"messages": MESSAGES}
            if kwargs is not None:
                body["chat_template_kwargs"] = kwargs
            tokens = (await client.post("/tokenize", json=body)).json()
            chat = await client.post("/v1/chat/completions", json={**body, "max_tokens": 1})
            assert chat.status_code == 200, chat.text
            assert chat.json()["usage"]["prompt_tokens"] == tokens["count"]
            return str(tokenizer.decode(tokens["tokens"]))

        assert await rendered(None) == oracle(False)
        assert oracle(False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert await rendered({"enable_thinking": True}) == oracle(True)
        assert await rendered({"enable_thinking": False, "other": [1, {"a": None}]}) == oracle(
            False
        )
    assert [r.chat_template_kwargs for r in engine.submitted] == [
        {"enable_thinking": False},
        {"enable_thinking": True},
        {"enable_thinking": False, "other": [1, {"a": None}]},
    ]


def nested(depth: int) -> dict[str, Any]:
    """chat_template_kwargs whose objects nest `depth` levels, itself included."""
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({f"v{i}": i for i in range(65)}, "object_above_max_properties"),
        (nested(9), "json_too_deep"),
        ({"text": "é" * 65_536}, "string_above_max_length"),
        ({"tools": []}, None),  # a name the server sets
        ({"add_generation_prompt": False}, None),
    ],
)
async def test_template_kwargs_are_bounded(
    client: AsyncTestClient, engine: FakeEngine, kwargs: dict[str, Any], code: str | None
) -> None:
    body = {"messages": MESSAGES, "chat_template_kwargs": kwargs}
    for path in ("/v1/chat/completions", "/tokenize"):
        r = await client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (
            "chat_template_kwargs",
            code,
            "BadRequestError",
        )
    assert all(r.chat_template_kwargs == kwargs for r in engine.submitted)  # the graph's 400


async def test_template_kwargs_at_their_bounds_are_served(client: AsyncTestClient) -> None:
    for kwargs in ({f"v{i}": i for i in range(64)}, nested(8), {"text": "é" * 65_000}):
        body = {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": kwargs}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text


# -- echo and prompt_logprobs ------------------------------------------------------------


async def post_chat(client: AsyncTestClient, body: dict[str, Any]) -> dict[str, Any]:
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def test_echo_opens_the_answer_with_the_continued_message(
    client: AsyncTestClient,
) -> None:
    """vLLM's echo: without a generation prompt the answer continues the last message,
    whose content opens it, whole or streamed (after the role, before the output)."""
    messages = [*MESSAGES, {"role": "assistant", "content": "Blue is"}]
    body = {"messages": messages, "max_tokens": 3, "add_generation_prompt": False, "n": 2}
    plain = await post_chat(client, body)
    echoed = await post_chat(client, {**body, "echo": True})
    for without, with_echo in zip(plain["choices"], echoed["choices"], strict=True):
        assert with_echo["message"] == {
            "role": "assistant",
            "content": "Blue is" + without["message"]["content"],
        }
    assert echoed["usage"] == plain["usage"]  # the echo is the prompt's, not generated
    r = await client.post("/v1/chat/completions", json={**body, "echo": True, "stream": True})
    events = sse_events(r.text)
    deltas = [(e["choices"][0]["index"], e["choices"][0]["delta"]) for e in events]
    assert deltas[:4] == [
        (0, {"role": "assistant", "content": ""}),
        (1, {"role": "assistant", "content": ""}),
        (0, {"content": "Blue is"}),
        (1, {"content": "Blue is"}),
    ]
    for choice in echoed["choices"]:
        streamed = "".join(d.get("content", "") for i, d in deltas if i == choice["index"])
        assert streamed == choice["message"]["content"]


async def test_echo_needs_a_message_of_the_answers_role(client: AsyncTestClient) -> None:
    body = {"messages": MESSAGES, "max_tokens": 2}
    plain = await post_chat(client, body)
    # A generation prompt after a user message: the answer is a new assistant message.
    assert (await post_chat(client, {**body, "echo": True}))["choices"] == plain["choices"]
    # No generation prompt: the answer continues the user's message, with its role (vLLM).
    body = {**body, "add_generation_prompt": False}
    plain = await post_chat(client, body)
    (choice,) = (await post_chat(client, {**body, "echo": True}))["choices"]
    assert choice["message"] == {
        "role": "user",
        "content": "Name a colour." + plain["choices"][0]["message"]["content"],
    }


async def test_chat_prompt_logprobs_are_the_completions_of_the_same_prompt(
    client: AsyncTestClient, tokenizer: Any
) -> None:
    ids = (await client.post("/tokenize", json={"messages": MESSAGES})).json()["tokens"]
    chat = await post_chat(
        client, {"messages": MESSAGES, "max_tokens": 1, "n": 2, "prompt_logprobs": 2}
    )
    r = await client.post(
        "/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    )
    entries = chat["prompt_logprobs"]
    assert entries == r.json()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for j in range(1, len(ids)):  # the fake engine's formula, independently
        assert entries[j][str(ids[j])] == {
            "logprob": prompt_logprob(j),
            "rank": 1,
            "decoded_token": tokenizer.decode([ids[j]]),
        }
        assert len(entries[j]) == 2  # the prompt token and one more of the top 2
    assert "prompt_logprobs" not in await post_chat(client, {"messages": MESSAGES, "max_tokens": 1})


@pytest.mark.parametrize(
    "extra",
    [{"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1}],
)
async def test_chat_prompt_logprobs_bounds(client: AsyncTestClient, extra: dict[str, Any]) -> None:
    r = await client.post("/v1/chat/completions", json={"messages": MESSAGES, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs"


# -- continuous usage stats --------------------------------------------------------------


@pytest.mark.parametrize("include_usage", [False, True])
async def test_chat_continuous_usage_stats(
    client: AsyncTestClient, tokenizer: Any, include_usage: bool
) -> None:
    """Every chunk carries its choice's usage so far (the role chunks none generated yet),
    as vLLM's; the last chunk the request's when include_usage is set too."""
    body = {"messages": MESSAGES, "max_tokens": 3, "n": 2, "stream": True}
    options = {"continuous_usage_stats": True, "include_usage": include_usage}
    events = sse_events(
        (await client.post("/v1/chat/completions", json={**body, "stream_options": options})).text
    )
    prompt = len(rendered_ids(tokenizer, MESSAGES))
    nothing_yet = {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}
    so_far = {0: 0, 1: 0}
    for event in [e for e in events if e["choices"]]:
        (choice,) = event["choices"]
        usage = event["usage"]
        if "role" in choice["delta"]:
            assert usage == nothing_yet
            continue
        assert usage["prompt_tokens"] == prompt
        assert usage["completion_tokens"] > so_far[choice["index"]]  # one more token each
        assert usage["total_tokens"] == prompt + usage["completion_tokens"]
        so_far[choice["index"]] = usage["completion_tokens"]
    assert so_far == {0: 3, 1: 3}
    last = [e for e in events if not e["choices"]]
    if include_usage:
        assert [e["usage"] for e in last] == [
            {"prompt_tokens": prompt, "completion_tokens": 6, "total_tokens": prompt + 6}
        ]
    else:
        assert last == []
