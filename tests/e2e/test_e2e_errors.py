"""Every error class over real HTTP, with its status and OpenAI's JSON shape; the other
endpoints; the API key on and off."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from e2e_helpers import API_KEY, assert_error
from server_process import ServerProcess

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def _post(server: ServerProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, "max_tokens", None),
        (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, "temperature", None),
        (COMPLETIONS, {"prompt": "x", "top_p": 1.5}, "top_p", None),
        (COMPLETIONS, {"prompt": "x", "n": 0}, "n", None),
        (COMPLETIONS, {"prompt": "x", "logprobs": 1000}, "logprobs", None),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "many"}, "max_tokens", "invalid_type"),
        (COMPLETIONS, {"max_tokens": 3}, "prompt", "invalid_type"),
        (COMPLETIONS, {"prompt": []}, "prompt", "empty_array"),
        (COMPLETIONS, {"prompt": [[]]}, "prompt", "empty_array"),
        (COMPLETIONS, {"prompt": ""}, "prompt", "empty_string"),
        (COMPLETIONS, {"prompt": ["ok", ""]}, "prompt", "empty_string"),
        (COMPLETIONS, {"prompt": [1, "a"]}, "prompt", "invalid_type"),
        (COMPLETIONS, {"prompt": [99999999]}, None, None),
        (COMPLETIONS, {"prompt": "x", "suffix": "y"}, "suffix", None),
        (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options", None),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 600}, None, "context_length_exceeded"),
        (COMPLETIONS, {"prompt": "hello " * 600, "max_tokens": 1}, None,
         "context_length_exceeded"),
        (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", None),
        (CHAT, {"messages": "hi"}, "messages", "invalid_type"),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
         "tools", None),
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
         "top_logprobs", None),
    ],
)  # fmt: skip
def test_bad_request_400(
    server: ServerProcess, path: str, body: dict[str, Any], param: str | None, code: str | None
) -> None:
    error = assert_error(_post(server, path, body), 400, code=code)
    assert error["type"] == "BadRequestError"
    if param is not None:
        assert error["param"] == param, error


def test_invalid_json_400(server: ServerProcess) -> None:
    response = httpx.post(
        f"{server.url}{COMPLETIONS}",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert assert_error(response, 400, code="invalid_json")["type"] == "BadRequestError"


def test_unknown_model_404(server: ServerProcess) -> None:
    for path, body in (
        (COMPLETIONS, {"model": "no-such-model", "prompt": "x"}),
        (CHAT, {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}),
        ("/tokenize", {"model": "no-such-model", "prompt": "x"}),
    ):
        error = assert_error(_post(server, path, body), 404, code="model_not_found")
        assert (error["type"], error["param"]) == ("NotFoundError", "model")
    with pytest.raises(openai.NotFoundError) as raised:
        server.client().completions.create(model="no-such-model", prompt="x")
    assert raised.value.status_code == 404


def test_route_404_and_method_405(server: ServerProcess) -> None:
    error = assert_error(httpx.get(f"{server.url}/v1/nothing-here", timeout=30), 404)
    assert error["type"] == "NotFoundError" and "/v1/nothing-here" in error["message"]
    error = assert_error(httpx.get(f"{server.url}{COMPLETIONS}", timeout=30), 405)
    assert error["type"] == "MethodNotAllowedError"


def test_body_too_large_413(server: ServerProcess) -> None:
    body = b'{"prompt": "' + b"a" * 11_000_000 + b'"}'  # past the 10 MB request limit
    response = httpx.post(
        f"{server.url}{COMPLETIONS}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert assert_error(response, 413)["type"] == "RequestTooLargeError"


def test_stream_error_before_first_event_keeps_status(server: ServerProcess) -> None:
    """A streamed request the graph rejects still answers with the HTTP error, not SSE."""
    body = {"prompt": "x", "max_tokens": 600, "stream": True}
    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=body, timeout=30) as response:
        response.read()
    assert_error(response, 400, code="context_length_exceeded")


def test_sdk_raises_typed_errors(server: ServerProcess) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=server.model, prompt="x", max_tokens=600)
    assert raised.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=server.model, messages=[{"role": "user", "content": "x"}], temperature=-1
        )


def test_other_endpoints(server: ServerProcess, gpt2_tokenizer: Any) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    version = httpx.get(f"{server.url}/version", timeout=10).json()
    assert isinstance(version["version"], str) and version["version"]
    models = server.client().models.list()
    assert [m.id for m in models.data] == [server.model]
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert (card["object"], card["max_model_len"]) == ("model", 512)

    text = "Hello, world! Ünïcödé"
    tokens = _post(server, "/tokenize", {"prompt": text}).json()
    assert tokens["tokens"] == gpt2_tokenizer.encode(text)
    assert (tokens["count"], tokens["max_model_len"]) == (len(tokens["tokens"]), 512)
    back = _post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()
    assert back == {"prompt": text}
    assert_error(_post(server, "/detokenize", {"tokens": [10**9]}), 400)

    metrics = httpx.get(f"{server.url}/metrics", timeout=10)
    assert metrics.status_code == 200
    for name in (
        "flowllm:num_requests_running",
        "flowllm:kv_cache_usage_perc",
        "flowllm:generation_tokens_total",
        "flowllm:time_to_first_token_seconds",
    ):
        assert name in metrics.text, name  # fmt: skip


def test_request_id_header(server: ServerProcess) -> None:
    response = _post(
        server, COMPLETIONS, {"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": "abc-1"}
    )
    assert response.headers["x-request-id"] == "abc-1"
    assert response.json()["id"] == "cmpl-abc-1"


# -- the API key -------------------------------------------------------------------------


def test_auth_off_accepts_any_or_no_key(server: ServerProcess) -> None:
    body = {"prompt": "x", "max_tokens": 1}
    assert _post(server, COMPLETIONS, body).status_code == 200
    assert (
        _post(server, COMPLETIONS, body, headers={"Authorization": "Bearer x"}).status_code == 200
    )


def test_auth_on(auth_server: ServerProcess) -> None:
    body = {"prompt": "x", "max_tokens": 2}
    missing = _post(auth_server, COMPLETIONS, body)
    error = assert_error(missing, 401, code="invalid_api_key")
    assert error["type"] == "AuthenticationError"
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = _post(auth_server, COMPLETIONS, body, headers={"Authorization": "Bearer nope"})
    assert_error(wrong, 401, code="invalid_api_key")
    basic = _post(
        auth_server, CHAT, {"messages": []}, headers={"Authorization": f"Basic {API_KEY}"}
    )
    assert_error(basic, 401)
    assert_error(httpx.get(f"{auth_server.url}/v1/models", timeout=10), 401)

    ok = _post(auth_server, COMPLETIONS, body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    # Health checks and metrics scrapes need no key (nor do /version, /docs, /openapi.json).
    assert httpx.get(f"{auth_server.url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{auth_server.url}/metrics", timeout=10).status_code == 200

    with pytest.raises(openai.AuthenticationError):
        auth_server.client(api_key="wrong").models.list()
    client = auth_server.client(api_key=API_KEY)
    stream = client.completions.create(
        model=auth_server.model, prompt="x", max_tokens=3, stream=True
    )
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) >= 1
