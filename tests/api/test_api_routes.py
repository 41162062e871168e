"""The routes around generation: models, health, version, metrics, tokenize, API key."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from api_fake_engine import CHAT_TEMPLATE, MODEL, FakeEngine, make_app
from litestar.testing import AsyncTestClient

import flowllm
from flowllm.graph.stage import NoParams
from flowllm.stages.tokenize import Tokenize

pytestmark = pytest.mark.anyio


async def test_models(client: AsyncTestClient, engine: FakeEngine) -> None:
    r = await client.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == engine.max_model_len
    assert isinstance(card["created"], int) and card["owned_by"] == "flowllm"


async def test_served_model_name_differs_from_model(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    async with AsyncTestClient(make_app(engine, served_model_name="my-name")) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        assert (card["id"], card["root"]) == ("my-name", MODEL)
        assert (
            await client.post("/tokenize", json={"model": MODEL, "prompt": "x"})
        ).status_code == 404
        r = await client.post("/tokenize", json={"model": "my-name", "prompt": "x"})
        assert r.status_code == 200


async def test_health(client: AsyncTestClient, engine: FakeEngine) -> None:
    r = await client.get("/health")
    assert r.status_code == 200
    engine.is_healthy = False
    r = await client.get("/health")
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "ServiceUnavailableError"


async def test_version(client: AsyncTestClient) -> None:
    assert (await client.get("/version")).json() == {"version": flowllm.__version__}


async def test_metrics_renders_the_engine_registry(client: AsyncTestClient) -> None:
    await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "flowllm:fake_requests_total 1.0" in r.text


async def test_metrics_registry_getter(engine: FakeEngine) -> None:
    from prometheus_client import CollectorRegistry, Gauge

    registry = CollectorRegistry()
    Gauge("flowllm:custom", "A custom gauge.", registry=registry).set(3)
    app = make_app(engine, metrics_registry=lambda _engine: registry)
    async with AsyncTestClient(app) as client:
        text = (await client.get("/metrics")).text
    assert "flowllm:custom 3.0" in text and "fake_requests" not in text


async def test_tokenize_and_detokenize(client: AsyncTestClient, tokenizer: Any) -> None:
    text = "Hello, tokenizer world!"
    r = await client.post("/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200
    ids = tokenizer.encode(text)
    assert r.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids}
    r = await client.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.json() == {"prompt": text}


async def test_tokenize_chat_messages(client: AsyncTestClient, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = await client.post("/tokenize", json={"messages": messages})
    expected = tokenizer.apply_chat_template(
        messages, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    assert r.json()["tokens"] == tokenizer.encode(expected, add_special_tokens=False)


# A template that shows tools and tool turns itself (the other, CHAT_TEMPLATE, ignores them:
# the tools then go into the system prompt).
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.function.name }}]{% endfor %}"
    "{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18C"},
]


@pytest.mark.parametrize("template", [CHAT_TEMPLATE, TOOLS_TEMPLATE], ids=["fallback", "native"])
async def test_tokenize_with_tools_gives_the_ids_generation_runs_on(
    engine: FakeEngine, tokenizer: Any, template: str
) -> None:
    """/tokenize of a chat request with tools: the ids the graph's tokenize stage makes of
    the very request the chat route submits for the same body."""
    body = {"messages": TOOL_TURNS, "tools": [WEATHER_TOOL], "chat_template_kwargs": {"x": 1}}
    async with AsyncTestClient(make_app(engine, chat_template=template)) as client:
        r = await client.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        chat = await client.post(
            "/v1/chat/completions", json={**body, "tool_choice": "none", "max_tokens": 1}
        )
        assert chat.status_code == 200, chat.text
    (submitted,) = engine.submitted
    services = SimpleNamespace(tokenizer=tokenizer, max_model_len=256, eos_token_ids=())
    stage = Tokenize(NoParams(), services)  # type: ignore[arg-type]
    tokens = r.json()["tokens"]
    assert tokens == list(stage.prompt_token_ids(submitted))
    text = tokenizer.decode(tokens)
    assert "get_weather" in text and "18C" in text


async def test_tokenize_errors(client: AsyncTestClient, engine: FakeEngine) -> None:
    r = await client.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `nope` does not exist."
    r = await client.post("/tokenize", json={})
    assert r.status_code == 400
    bad_tool = {"type": "function", "function": {"name": "no spaces"}}
    r = await client.post("/tokenize", json={"messages": TOOL_TURNS, "tools": [bad_tool]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.name"
    r = await client.post("/detokenize", json={"tokens": [1, 10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = await client.post("/detokenize", json={"tokens": "abc"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


async def test_tokenize_without_chat_template(engine: FakeEngine) -> None:
    async with AsyncTestClient(make_app(engine, chat_template=None)) as client:
        r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400
    assert "chat template" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": "Basic s3cret"}, 401),
        ({"Authorization": "bearer s3cret"}, 200),
        ({"Authorization": "Bearer s3cret"}, 200),
    ],
)
async def test_api_key_on_v1(engine: FakeEngine, headers: dict[str, str], status: int) -> None:
    async with AsyncTestClient(make_app(engine, api_key="s3cret")) as client:
        r = await client.get("/v1/models", headers=headers)
        assert r.status_code == status
        if status == 401:
            error = r.json()["error"]
            assert (error["type"], error["code"]) == ("AuthenticationError", "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        r = await client.post(
            "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers
        )
        assert r.status_code == status
        # Health probes and Prometheus need no key; /tokenize does (test_api_security).
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
    if status == 401:
        assert engine.submitted == []


async def test_tokenize_uses_the_model_template_when_none_is_given(
    gpt2_tokenizer_dir: Any,
) -> None:
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(str(gpt2_tokenizer_dir))
    own.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    async with AsyncTestClient(make_app(FakeEngine(own), chat_template=None)) as client:
        messages = [{"role": "user", "content": "hello"}]
        r = await client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200
    assert own.decode(r.json()["tokens"]) == "[user] hello"
