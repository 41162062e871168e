"""Request limits and unsupported fields at the HTTP boundary: every refusal a 400 in
OpenAI's error shape naming its `param`, before anything is allocated for the request."""

from __future__ import annotations

import time
from typing import Any

import pytest
from api_fake_engine import FakeEngine, make_app
from litestar.testing import AsyncTestClient

from flowllm.api.protocol import UNSUPPORTED_FIELDS, ChatCompletionRequest, CompletionRequest
from flowllm.config import engine_config

pytestmark = pytest.mark.anyio

HUGE = "9" * 400
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


def assert_400(response: Any, param: str | None) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError"
    assert error["param"] == param, error
    assert len(error["message"]) < 400, error["message"]
    return error  # type: ignore[no-any-return]


async def post_raw(client: AsyncTestClient, path: str, body: bytes) -> Any:
    return await client.post(path, content=body, headers={"content-type": "application/json"})


@pytest.mark.parametrize("field", ["n", "max_tokens", "min_tokens", "logprobs"])
@pytest.mark.parametrize("sign", ["", "-"])
async def test_huge_integers_are_400s(client: AsyncTestClient, field: str, sign: str) -> None:
    body = b'{"prompt": "hi", "%s": %s%s}' % (field.encode(), sign.encode(), HUGE.encode())
    r = await post_raw(client, "/v1/completions", body)
    assert_400(r, field)


async def test_huge_integers_in_chat(client: AsyncTestClient) -> None:
    body = b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
    for value in (b"1" + b"0" * 400, b"-" + HUGE.encode(), b"21"):
        r = await post_raw(
            client, "/v1/chat/completions", body + b'"top_logprobs": ' + value + b"}"
        )
        assert_400(r, "top_logprobs")
    for field in (b"n", b"max_tokens", b"max_completion_tokens", b"min_tokens"):
        r = await post_raw(
            client, "/v1/chat/completions", body + b'"' + field + b'": ' + HUGE.encode() + b"}"
        )
        assert_400(r, "max_tokens" if field == b"max_completion_tokens" else field.decode())


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"prompt": "hi", "stop_token_ids": [9223372036854775808]}', "stop_token_ids"),
        (b'{"prompt": "hi", "logit_bias": {"9223372036854775808": 1}}', "logit_bias"),
        (b'{"prompt": "hi", "logit_bias": {"50257": 1}}', "logit_bias"),
        (b'{"prompt": [1, 2, 50257]}', "prompt"),
        (b'{"prompt": "hi", "temperature": 1e400}', "temperature"),
        (b'{"prompt": "hi", "repetition_penalty": 3}', "repetition_penalty"),
        (b'{"prompt": "hi", "n": 30000000}', "n"),
    ],
)
async def test_out_of_range_values(client: AsyncTestClient, body: bytes, param: str) -> None:
    assert_400(await post_raw(client, "/v1/completions", body), param)


async def test_too_many_prompts_is_a_400_not_a_503(client: AsyncTestClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": ["hi"] * 300, "max_tokens": 1})
    assert_400(r, "prompt")


async def test_the_token_budget(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, config=engine_config(max_request_tokens=100))
    async with AsyncTestClient(make_app(engine)) as client:
        r = await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 50})
        assert r.status_code == 200
        r = await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 51})
        assert_400(r, "max_tokens")
        r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": None})
        assert_400(r, "max_tokens")  # unset: the context length (256) counts
    assert engine.submitted == [engine.submitted[0], engine.submitted[1]]


async def test_stop_string_bounds(client: AsyncTestClient) -> None:
    r = await client.post("/v1/completions", json={**COMPLETION, "stop": ["a" * 40_000]})
    assert_400(r, "stop")
    r = await client.post("/v1/completions", json={**COMPLETION, "stop": ["x"] * 17})
    assert_400(r, "stop")


async def test_logit_bias_entries_are_bounded(client: AsyncTestClient) -> None:
    bias = {str(i): 1 for i in range(301)}
    r = await client.post("/v1/completions", json={**COMPLETION, "logit_bias": bias})
    assert_400(r, "logit_bias")


@pytest.mark.parametrize("depth", [65, 50_000])
async def test_deep_json_is_a_400(client: AsyncTestClient, depth: int) -> None:
    body = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    start = time.perf_counter()
    r = await post_raw(client, "/v1/completions", body)
    assert time.perf_counter() - start < 1.0
    error = assert_400(r, None)
    assert error["code"] == "json_too_deep"


async def test_brackets_in_strings_do_not_count(client: AsyncTestClient) -> None:
    r = await client.post("/v1/completions", json={**COMPLETION, "prompt": "[" * 200})
    assert r.status_code == 200, r.text


async def test_a_decoder_recursion_error_is_a_400(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, config=engine_config(max_json_depth=10**6))
    async with AsyncTestClient(make_app(engine)) as client:
        body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = await post_raw(client, "/v1/completions", body)
    assert_400(r, None)


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
async def test_unsupported_fields_are_refused_by_name(client: AsyncTestClient, field: str) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, field: True})
    error = assert_400(r, field)
    assert error["code"] == "unsupported_parameter" and "not supported" in error["message"]
    r = await client.post("/v1/completions", json={**COMPLETION, field: True})
    assert_400(r, field)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        # auto tool choice (the default with tools) needs --enable-auto-tool-choice
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),  # no tools
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
async def test_chat_options_not_implemented(
    client: AsyncTestClient, extra: dict[str, Any], param: str
) -> None:
    assert_400(await client.post("/v1/chat/completions", json={**CHAT, **extra}), param)


async def test_unknown_nested_fields_are_named(client: AsyncTestClient) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "hi", "colour": "red"}]}
    error = assert_400(await client.post("/v1/chat/completions", json=body), "messages[0].colour")
    assert error["code"] == "unknown_parameter"
    call = {"id": "c", "function": {"name": "f", "arguments": "{}"}, "colour": "red"}
    body = {**CHAT, "messages": [{"role": "assistant", "content": "", "tool_calls": [call]}]}
    r = await client.post("/v1/chat/completions", json=body)
    assert_400(r, "messages[0].tool_calls[0].colour")
    r = await client.post(
        "/v1/chat/completions", json={**CHAT, "stream": True, "stream_options": {"x": 1}}
    )
    assert_400(r, "stream_options.x")


async def test_harmless_metadata_and_defaults_are_accepted(client: AsyncTestClient) -> None:
    extra = {
        "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
        "prompt_cache_key": "k", "safety_identifier": "s", "tools": [], "tool_choice": "none",
        "response_format": {"type": "text"}, "modalities": ["text"],
        "stream_options": {"include_usage": True, "include_obfuscation": False}, "stream": True,
    }  # fmt: skip
    messages = [
        {"role": "user", "content": "hi", "name": "me"},
        {"role": "assistant", "content": "yo", "refusal": None, "tool_calls": None},
        {"role": "user", "content": "again"},
    ]
    r = await client.post("/v1/chat/completions", json={**CHAT, **extra, "messages": messages})
    assert r.status_code == 200, r.text
    r = await client.post("/v1/completions", json={**COMPLETION, "user": "u", "seed": 1})
    assert r.status_code == 200, r.text


def test_every_openai_sdk_field_is_declared_or_named_unsupported() -> None:
    """What openai's `completions.create` / `chat.completions.create` can send: each field is
    implemented, accepted as harmless metadata, or refused by name."""
    completions = {
        "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs",
        "max_tokens", "n", "presence_penalty", "seed", "stop", "stream", "stream_options",
        "suffix", "temperature", "top_p", "user",
    }  # fmt: skip
    chat = {
        "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
        "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata",
        "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty",
        "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
        "service_tier", "stop", "store", "stream", "stream_options", "temperature",
        "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
        "web_search_options",
    }  # fmt: skip
    known = set(UNSUPPORTED_FIELDS)
    assert completions <= set(CompletionRequest.__struct_fields__) | known
    assert chat <= set(ChatCompletionRequest.__struct_fields__) | known


async def test_tokenize_and_detokenize_refuse_unknown_fields(client: AsyncTestClient) -> None:
    r = await client.post("/tokenize", json={"prompt": "hi", "return_token_strs": True})
    assert_400(r, "return_token_strs")
    r = await client.post("/detokenize", json={"tokens": [1], "extra": 1})
    assert_400(r, "extra")
    body = b'{"tokens": [' + HUGE.encode() + b"]}"
    assert_400(await post_raw(client, "/detokenize", body), "tokens")


@pytest.mark.parametrize(
    "template",
    ['{{ raise_exception("no") }}', "{{ a.b.c }}", "{{ 1 + 'a' }}", "{% for %}", "{{ 1 / 0 }}"],
)
async def test_a_failing_chat_template_is_the_clients_400(
    client: AsyncTestClient, template: str
) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, "chat_template": template})
    assert_400(r, "chat_template")
    r = await client.post(
        "/tokenize", json={"messages": CHAT["messages"], "chat_template": template}
    )
    assert_400(r, "chat_template")
