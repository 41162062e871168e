"""The HTTP boundary: the API key on every route, JSON-only bodies, CORS, the OpenAPI
document (checked against what the openai SDK sends), cache_salt."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from api_fake_engine import CHAT_TEMPLATE, MODEL, FakeEngine, make_app
from litestar.config.cors import CORSConfig
from litestar.routes import HTTPRoute
from litestar.testing import AsyncTestClient

from flowllm.api.app import PUBLIC_PATHS, is_json, is_public

pytestmark = pytest.mark.anyio

KEY = "s3cret"
# A body each POST route accepts.
BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1, 2]},
}
# The fake engine generates: with the key, the pooling routes answer that they need a
# model served for pooling.
POOLING_BODIES: dict[str, dict[str, Any]] = {
    "/v1/embeddings": {"input": "hi"},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/score": {"text_1": "a", "text_2": "b"},
    "/v1/rerank": {"query": "a", "documents": ["b"]},
    "/rerank": {"query": "a", "documents": ["b"]},
    "/v2/rerank": {"query": "a", "documents": ["b"]},
}


def app_routes(app: Any) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, OPTIONS and HEAD aside."""
    out = []
    for route in app.routes:
        if isinstance(route, HTTPRoute):
            out += [(m, route.path) for m in route.methods if m not in ("OPTIONS", "HEAD")]
    return sorted(out)


# -- the API key -------------------------------------------------------------------------


async def test_every_route_but_the_public_ones_needs_the_key(engine: FakeEngine) -> None:
    app = make_app(engine, api_key=KEY, ui=False)  # the page's routes: tests/ui
    routes = app_routes(app)
    assert {path for _, path in routes} >= set(BODIES) | PUBLIC_PATHS | {"/v1/models"}
    async with AsyncTestClient(app) as client:
        for method, path in routes:
            body = BODIES.get(path) or POOLING_BODIES.get(path)
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = await client.request(method, path, json=body, headers=headers)
                if is_public(path):
                    assert r.status_code == 200, (method, path, r.text)
                else:
                    assert r.status_code == 401, (method, path, r.text)
                    error = r.json()["error"]
                    assert (error["type"], error["code"]) == (
                        "AuthenticationError",
                        "invalid_api_key",
                    )
            if not is_public(path):
                r = await client.request(
                    method, path, json=body, headers={"Authorization": f"Bearer {KEY}"}
                )
                if path in POOLING_BODIES:
                    assert r.status_code == 400, (method, path, r.text)
                    assert r.json()["error"]["code"] == "unsupported_task"
                else:
                    assert r.status_code == 200, (method, path, r.text)
    assert {p for _, p in routes if is_public(p)} == PUBLIC_PATHS
    assert len(engine.submitted) == 2  # the two generation routes, with the key only


async def test_tokenize_needs_the_key(engine: FakeEngine) -> None:
    async with AsyncTestClient(make_app(engine, api_key=KEY)) as client:
        assert (await client.post("/tokenize", json={"prompt": "x"})).status_code == 401
        assert (await client.post("/detokenize", json={"tokens": [1]})).status_code == 401


def test_public_paths() -> None:
    assert is_public("/health") and is_public("/docs") and is_public("/openapi.json")
    assert is_public("/docs/swagger.js")
    assert not is_public("/tokenize") and not is_public("/v1/models")
    assert not is_public("/docsx") and not is_public("/health/x")


# -- JSON only ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content_type", "ok"),
    [
        (b"application/json", True),
        (b"application/json; charset=utf-8", True),
        (b"Application/JSON;charset=\"UTF-8\"", True),
        (b"application/json; charset=latin-1", False),
        (b"application/json; boundary=x", False),
        (b"text/plain", False),
        (b"text/plain; charset=utf-8", False),
        (b"application/x-www-form-urlencoded", False),
        (b"multipart/form-data; boundary=x", False),
        (b"application/jsonx", False),
        (b"", False),
    ],
)
def test_is_json(content_type: bytes, ok: bool) -> None:
    assert is_json(content_type) is ok


@pytest.mark.parametrize("path", sorted(BODIES))
@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
async def test_post_bodies_must_be_json(
    client: AsyncTestClient, engine: FakeEngine, path: str, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"content-type": content_type}
    r = await client.post(path, content=json.dumps(BODIES[path]).encode(), headers=headers)
    assert r.status_code == 415
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("UnsupportedMediaTypeError", "unsupported_media_type")
    assert "application/json" in error["message"]
    assert engine.submitted == []
    ok = await client.post(
        path,
        content=json.dumps(BODIES[path]).encode(),
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200


async def test_the_key_is_checked_before_the_media_type(engine: FakeEngine) -> None:
    async with AsyncTestClient(make_app(engine, api_key=KEY)) as client:
        r = await client.post("/v1/completions", content=b"{}", headers={"content-type": "x/y"})
        assert r.status_code == 401


# -- CORS --------------------------------------------------------------------------------


async def test_no_cors_headers_by_default(client: AsyncTestClient) -> None:
    r = await client.get("/v1/models", headers={"Origin": "https://evil.example"})
    assert r.status_code == 200
    assert not any(h.startswith("access-control-") for h in r.headers)
    pre = await client.options(
        "/v1/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in pre.headers


async def test_cors_allowed_origins(engine: FakeEngine) -> None:
    cors = CORSConfig(
        allow_origins=["https://a.example"],
        allow_methods=["GET", "POST"],
        allow_headers=["authorization", "content-type"],
        allow_credentials=True,
    )
    async with AsyncTestClient(make_app(engine, api_key=KEY, cors=cors)) as client:
        # The preflight carries no key; it must still be answered.
        pre = await client.options(
            "/v1/chat/completions",
            headers={
                "Origin": "https://a.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert pre.status_code in (200, 204), pre.text
        assert pre.headers["access-control-allow-origin"] == "https://a.example"
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert pre.headers["access-control-allow-credentials"] == "true"
        r = await client.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"Origin": "https://a.example", "Authorization": f"Bearer {KEY}"},
        )
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://a.example"
        other = await client.get(
            "/v1/models",
            headers={"Origin": "https://evil.example", "Authorization": f"Bearer {KEY}"},
        )
        assert "access-control-allow-origin" not in other.headers


# -- OpenAPI -----------------------------------------------------------------------------


async def test_openapi_describes_every_route(engine: FakeEngine) -> None:
    app = make_app(engine, api_key=KEY, ui=False)  # the page's own routes: docs/ui.md
    async with AsyncTestClient(app) as client:
        r = await client.get("/openapi.json")
        assert r.status_code == 200
        doc = r.json()
        docs = await client.get("/docs")
    assert doc["openapi"].startswith("3.1")
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    served = {(m, p) for m, p in app_routes(app) if p not in ("/openapi.json", "/docs")}
    assert documented == served
    for (method, path), body in ((("POST", p), b) for p, b in BODIES.items()):
        operation = doc["paths"][path][method.lower()]
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        validate(doc, schema, body)
        assert "application/json" in operation["responses"]["200"]["content"]
        assert operation["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/health"]["get"]
    stream = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert stream["text/event-stream"]["schema"]["$ref"].endswith("ChatCompletionStreamResponse")
    assert {"CompletionRequest", "ChatCompletionRequest", "ErrorResponse"} <= set(
        doc["components"]["schemas"]
    )
    assert docs.status_code == 200 and docs.headers["content-type"].startswith("text/html")
    assert "SwaggerUIBundle" in docs.text and "/v1/chat/completions" in docs.text


def validate(doc: dict[str, Any], schema: dict[str, Any], instance: Any) -> None:
    """`instance` against a schema of the document (its $refs point into components)."""
    jsonschema.Draft202012Validator({**schema, "components": doc["components"]}).validate(
        instance
    )


def invalid(doc: dict[str, Any], schema: dict[str, Any], instance: Any) -> bool:
    try:
        validate(doc, schema, instance)
    except jsonschema.ValidationError:
        return True
    return False


def sdk_bodies() -> dict[str, list[dict[str, Any]]]:
    """The JSON bodies the openai SDK sends for completions and chat, streaming and not."""
    captured: dict[str, list[dict[str, Any]]] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["content-type"] == "application/json"
        body = json.loads(request.content)
        captured.setdefault(request.url.path, []).append(body)
        if body.get("stream"):
            return httpx.Response(
                200, content=b"data: [DONE]\n\n", headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, json={"id": "x", "object": "list", "choices": []})

    client = openai.OpenAI(
        base_url="http://sdk.invalid/v1",
        api_key="k",
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    common: dict[str, Any] = {
        "model": MODEL,
        "temperature": 0.7,
        "top_p": 0.9,
        "n": 2,
        "stop": ["\n", "END"],
        "seed": 7,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "logit_bias": {"50256": -100},
        "user": "u-1",
    }
    extra = {"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "cache_salt": "tenant-a"}
    for stream in (False, True):
        options: dict[str, Any] = {"stream_options": {"include_usage": True}} if stream else {}
        for prompt in ("Hello", ["a", "b"], [1, 2, 3], [[1, 2], [3]]):
            result = client.completions.create(
                prompt=prompt,
                max_tokens=8,
                echo=True,
                logprobs=2,
                stream=stream,
                extra_body=extra,
                **common,
                **options,
            )
            if stream:
                list(result)  # type: ignore[arg-type]
        result = client.chat.completions.create(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Name a colour.", "name": "bob"},
            ],
            max_completion_tokens=16,
            max_tokens=16,
            logprobs=True,
            top_logprobs=2,
            response_format={"type": "text"},
            stream=stream,
            extra_body={**extra, "chat_template_kwargs": {"enable_thinking": False}},
            **common,
            **options,
        )
        if stream:
            list(result)  # type: ignore[arg-type]
    return captured


async def test_openapi_request_schemas_accept_what_the_sdk_sends(client: AsyncTestClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    captured = sdk_bodies()
    assert len(captured["/v1/completions"]) == 8 and len(captured["/v1/chat/completions"]) == 2
    for path, bodies in captured.items():
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        for body in bodies:
            validate(doc, schema["schema"], body)
    # And the schemas are not vacuous: what the server refuses, they refuse too.
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    chat_schema = chat["application/json"]["schema"]
    assert invalid(doc, chat_schema, {"model": MODEL})  # no messages
    assert invalid(doc, chat_schema, {"messages": [{"role": "user"}], "n": "two"})
    assert invalid(doc, chat_schema, {"messages": [{"content": "x"}]})  # no role


async def test_responses_match_their_schemas(client: AsyncTestClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    for path, body in BODIES.items():
        r = await client.post(path, json=body)
        assert r.status_code == 200
        schema = doc["paths"][path]["post"]["responses"]["200"]["content"]["application/json"]
        validate(doc, schema["schema"], r.json())
    models = await client.get("/v1/models")
    schema = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]
    validate(doc, schema["schema"], models.json())
    bad = await client.post("/v1/completions", json={"prompt": "x", "n": "two"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"
    error = doc["paths"]["/v1/completions"]["post"]["responses"]["400"]["content"]
    validate(doc, error["application/json"]["schema"], bad.json())


# -- request templates on /tokenize ------------------------------------------------------


async def test_tokenize_refuses_request_templates_unless_trusted(engine: FakeEngine) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": CHAT_TEMPLATE}
    async with AsyncTestClient(make_app(engine)) as client:
        r = await client.post("/tokenize", json=body)
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "chat_template"
    async with AsyncTestClient(make_app(engine, trust_request_chat_template=True)) as client:
        assert (await client.post("/tokenize", json=body)).status_code == 200


# -- cache_salt --------------------------------------------------------------------------


async def test_cache_salt_reaches_the_graph(client: AsyncTestClient, engine: FakeEngine) -> None:
    r = await client.post(
        "/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1, "cache_salt": "t1"}
    )
    assert r.status_code == 200
    r = await client.post(
        "/v1/chat/completions", json={**BODIES["/v1/chat/completions"], "cache_salt": "t2"}
    )
    assert r.status_code == 200
    await client.post("/v1/completions", json={"prompt": "c", "max_tokens": 1})
    assert [s.cache_salt for s in engine.submitted] == ["t1", "t1", "t2", None]
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = await client.post(path, json={**BODIES[path], "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
