"""The app behind a real uvicorn server on 127.0.0.1: the openai SDK (sync and async), raw
httpx, and client disconnects that must abort the request in the graph."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from api_fake_engine import MODEL, FakeEngine, expected_tokens
from server_process import wait_until
from uvicorn_server import Server

API_KEY = "test-key"


@pytest.fixture(scope="module")
def server(tokenizer: Any) -> Iterator[Server]:
    with Server(FakeEngine(tokenizer), api_key=API_KEY) as running:
        yield running


@pytest.fixture
def sdk(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def test_sdk_completion_with_echo_logprobs(sdk: openai.OpenAI, tokenizer: Any) -> None:
    text = "The capital of France is"
    out = sdk.completions.create(model=MODEL, prompt=text, max_tokens=2, echo=True, logprobs=1)
    choice = out.choices[0]
    ids = tokenizer.encode(text)
    assert choice.text == text + tokenizer.decode(expected_tokens(ids, 2, 0))
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.token_logprobs) == len(ids) + 2
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")


def test_sdk_chat_and_streaming(sdk: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Hi"}]
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
    assert whole.choices[0].message.role == "assistant"
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_sdk_errors(sdk: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        sdk.completions.create(model="nope", prompt="x")
    assert not_found.value.body == {  # type: ignore[comparison-overlap]
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": "model_not_found",
    }
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.completions.create(model=MODEL, prompt=" a" * 300, max_tokens=5)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as bad_range:
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=5, stream=True
        )
    assert bad_range.value.param == "temperature"
    anonymous = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()


def test_sdk_models(sdk: openai.OpenAI) -> None:
    (model,) = sdk.models.list().data
    assert model.id == MODEL


@pytest.mark.anyio
async def test_async_sdk_streaming_completion(server: Server, tokenizer: Any) -> None:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    stream = await client.completions.create(
        model=MODEL, prompt=["one two", "three"], max_tokens=3, n=2, stream=True
    )
    texts: dict[int, str] = {}
    async for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    for i, prompt in enumerate(["one two", "three"]):
        ids = tokenizer.encode(prompt)
        for c in range(2):
            assert texts[i * 2 + c] == tokenizer.decode(expected_tokens(ids, 3, c))
    await client.close()


def test_error_mid_stream_reaches_the_sdk(tokenizer: Any) -> None:
    with Server(FakeEngine(tokenizer, fail_after=2)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, stream=True)
        with pytest.raises(openai.APIError, match="The engine failed"):
            for _ in stream:
                pass


def test_overload_503_with_retry_after(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, max_pending=2, token_delay=0.05)
    auth = {"authorization": f"Bearer {API_KEY}"}
    body = {"prompt": "slow", "max_tokens": 40, "stream": True}
    with (
        Server(engine, api_key=API_KEY) as running,
        httpx.Client(base_url=running.url, timeout=10, headers=auth) as http,
        http.stream("POST", "/v1/completions", json=body) as first,
    ):
        first_lines = first.iter_lines()  # kept: dropping the iterator closes the connection
        assert next(first_lines).startswith("data: ")  # admitted and generating
        # Room for one more prompt, not two: admission refuses, its hint rounded up.
        refused = http.post("/v1/completions", json={"prompt": ["x", "y"], "max_tokens": 1})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["code"] == "server_overloaded"
        with http.stream("POST", "/v1/completions", json=body) as second:
            second_lines = second.iter_lines()
            assert next(second_lines).startswith("data: ")
            # Full: any request is refused at the door, before its body is read.
            door = http.post(
                "/v1/chat/completions",
                content=b"{not json",
                headers={"content-type": "application/json", "x-request-id": "door-1"},
            )
            assert door.status_code == 503, door.text
            assert door.headers["retry-after"] == "1"
            assert door.headers["x-request-id"] == "door-1"
            assert door.json() == {
                "error": {
                    "message": "The server is overloaded; retry later.",
                    "type": "ServiceUnavailableError",
                    "param": None,
                    "code": "server_overloaded",
                }
            }
            # The key and the media type are still checked first; other routes still answer.
            keyless = httpx.post(running.url + "/v1/completions", json={"prompt": "x"})
            assert keyless.status_code == 401
            assert http.post("/v1/completions", content=b"x").status_code == 415
            assert http.get("/health").status_code == 200
            assert http.post("/tokenize", json={"prompt": "x"}).status_code == 200
        assert len(engine.submitted) == 2  # nothing refused reached the engine


def test_streaming_client_disconnect_aborts(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, token_delay=0.02)
    with Server(engine) as running, httpx.Client(base_url=running.url, timeout=10) as http:
        body = {"prompt": ["a long story", "another"], "max_tokens": 200, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        ids = {r.request_id for r in engine.submitted}
        assert wait_until(lambda: set(engine.aborted) == ids), engine.aborted
        assert engine.completed == []


def test_waiting_client_disconnect_aborts(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, token_delay=0.02)
    with Server(engine) as running, httpx.Client(base_url=running.url, timeout=0.3) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json={"prompt": "wait", "max_tokens": 200})
        (request,) = engine.submitted
        assert wait_until(lambda: engine.aborted == [request.request_id]), engine.aborted
        assert engine.completed == []


def test_finished_requests_are_not_aborted(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    with Server(engine) as running, httpx.Client(base_url=running.url, timeout=10) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True})
        assert r.text.endswith("data: [DONE]\n\n")
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert wait_until(lambda: len(engine.completed) == 2)
    assert engine.aborted == []
