"""The security flags against real `flowllm serve` processes: the key on every route, JSON
only, request templates (refused, then budgeted), CORS, HTTPS and mutual TLS, an empty key,
the OpenAPI document, cache_salt."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import trustme
from e2e_helpers import API_KEY, CHAT_TEMPLATE, assert_error, start_server
from litestar.routes import HTTPRoute
from server_process import REPO, TINY_FLAGS, ServerProcess, wait_until

from flowllm.api.app import PUBLIC_PATHS, create_app, is_public

MESSAGES = [{"role": "user", "content": "Name a colour."}]
SLOW_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m.content }}{% endfor %}"
)
ORIGIN = "https://a.example"


def _post(server: ServerProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, **kwargs)


def served_routes() -> list[tuple[str, str]]:
    """Every (method, path) of the API `flowllm serve` runs (the engine is never started);
    the web page's routes are tested in tests/ui."""
    app = create_app(lambda: None, served_model_name="m", ui=False)  # type: ignore[arg-type,return-value]
    routes = []
    for route in app.routes:
        if isinstance(route, HTTPRoute):
            routes += [(m, route.path) for m in route.methods if m not in ("OPTIONS", "HEAD")]
    return sorted(routes)


@pytest.fixture(scope="module")
def trusted_server(gpt2_tiny_dir: Path, chat_template_file: Path) -> Iterator[ServerProcess]:
    """Request templates trusted (within the budget), CORS for ORIGIN."""
    flags = [
        *TINY_FLAGS,
        "--chat-template", str(chat_template_file),
        "--trust-request-chat-template",
        "--allowed-origins", json.dumps([ORIGIN]),
        "--allowed-methods", '["GET", "POST"]',
    ]  # fmt: skip
    proc = start_server(str(gpt2_tiny_dir), flags)
    try:
        yield proc
    finally:
        proc.stop()


# -- the API key on every route ----------------------------------------------------------


RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


def test_no_route_but_the_public_ones_answers_without_the_key(auth_server: ServerProcess) -> None:
    routes = served_routes()
    assert {p for _, p in routes} >= {"/tokenize", "/detokenize", "/v1/models", *PUBLIC_PATHS}
    bodies = {
        "/v1/completions": {"prompt": "x", "max_tokens": 1},
        "/v1/chat/completions": {"messages": MESSAGES, "max_tokens": 1},
        "/tokenize": {"prompt": "x"},
        "/detokenize": {"tokens": [1]},
        "/v1/embeddings": {"input": "x"},
        **{path: {"text_1": "x", "text_2": "y"} for path in ("/v1/score", "/score")},
        **{path: {"query": "x", "documents": ["y"]} for path in RERANK_PATHS},
    }
    pooling_routes = {"/v1/embeddings", "/v1/score", "/score", *RERANK_PATHS}
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.request(
                method, auth_server.url + path, json=bodies.get(path), headers=headers, timeout=60
            )
            if is_public(path):
                assert r.status_code == 200, (method, path)
            else:
                assert_error(r, 401, code="invalid_api_key")
        if not is_public(path):
            good = {"Authorization": f"Bearer {API_KEY}"}
            r = httpx.request(
                method, auth_server.url + path, json=bodies.get(path), headers=good, timeout=60
            )
            # Past the key; chat answers 400 as this server has no chat template, and the
            # pooling routes as it serves a generating model.
            expected = 400 if path == "/v1/chat/completions" or path in pooling_routes else 200
            assert r.status_code == expected, (method, path, r.text)


def _serve_exits(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flowllm", "serve", *args, "--port", "1"],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("args", "env_key", "shown"),
    [
        (["--api-key", ""], None, "--api-key"),
        (["--api-key", "  "], None, "--api-key"),
        ([], "", "FLOWLLM_API_KEY"),
    ],
)
def test_an_empty_key_is_a_startup_error(
    args: list[str], env_key: str | None, shown: str
) -> None:
    import os

    env = {k: v for k, v in os.environ.items() if k != "FLOWLLM_API_KEY"}
    if env_key is not None:
        env["FLOWLLM_API_KEY"] = env_key
    done = _serve_exits(["/nonexistent-model", *args], env)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and shown in lines[0], done.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--allowed-methods", '["GET"]'], "needs --allowed-origins"),
        (["--allowed-origins", "https://a.example"], "expected a JSON list"),
        (["--ssl-keyfile", "/nonexistent.key"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", "/nonexistent.pem"], "no such file"),
        (["--ssl-cert-reqs", "2"], "need --ssl-certfile"),
    ],
)
def test_bad_security_flags_fail_fast(args: list[str], message: str) -> None:
    import os

    done = _serve_exits(["/nonexistent-model", *args], dict(os.environ))
    assert done.returncode != 0
    assert message in done.stderr, done.stderr


# -- JSON only ---------------------------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_a_browser_simple_post_is_refused(server: ServerProcess, content_type: str) -> None:
    before = server.metrics().get("flowllm:request_success_total", 0.0)
    body = json.dumps({"prompt": "x", "max_tokens": 1})
    for path in ("/v1/completions", "/tokenize"):
        r = httpx.post(
            server.url + path, content=body, headers={"content-type": content_type}, timeout=60
        )
        error = assert_error(r, 415, code="unsupported_media_type")
        assert error["type"] == "UnsupportedMediaTypeError"
    assert server.metrics().get("flowllm:request_success_total", 0.0) == before
    ok = httpx.post(
        server.url + "/v1/completions",
        content=body,
        headers={"content-type": "application/json; charset=utf-8"},
        timeout=60,
    )
    assert ok.status_code == 200


# -- request chat templates --------------------------------------------------------------


def test_request_templates_are_refused_by_default(server: ServerProcess) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        r = _post(server, path, {"messages": MESSAGES, "chat_template": CHAT_TEMPLATE})
        error = assert_error(r, 400, code="untrusted_chat_template")
        assert error["param"] == "chat_template"


def test_trusted_request_template_renders(
    trusted_server: ServerProcess, gpt2_tokenizer: Any
) -> None:
    template = "{% for m in messages %}{{ greeting }} {{ m.content }}{% endfor %}"
    body = {
        "messages": MESSAGES,
        "chat_template": template,
        "chat_template_kwargs": {"greeting": "Hi!"},
    }
    r = _post(trusted_server, "/tokenize", body)
    assert r.status_code == 200, r.text
    assert gpt2_tokenizer.decode(r.json()["tokens"]) == "Hi! Name a colour."
    client = trusted_server.client()
    out = client.chat.completions.create(
        model=trusted_server.model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=2,
        extra_body={"chat_template": template, "chat_template_kwargs": {"greeting": "Hi!"}},
    )
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(r.json()["tokens"])


def test_nested_range_loops_end_in_a_quick_400(trusted_server: ServerProcess) -> None:
    """Without the budget this template keeps a thread busy for minutes."""
    for path in ("/v1/chat/completions", "/tokenize"):
        started = time.monotonic()
        r = _post(trusted_server, path, {"messages": MESSAGES, "chat_template": SLOW_TEMPLATE})
        elapsed = time.monotonic() - started
        error = assert_error(r, 400, code="template_budget_exceeded")
        assert error["param"] == "chat_template"
        assert elapsed < 15, f"{path} took {elapsed:.1f} s"
    # The server is still serving.
    ok = _post(trusted_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1})
    assert ok.status_code == 200


# -- CORS --------------------------------------------------------------------------------


def test_no_cors_headers_by_default(server: ServerProcess) -> None:
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert not any(h.startswith("access-control-") for h in r.headers)


def test_cors_for_the_allowed_origin(trusted_server: ServerProcess) -> None:
    pre = httpx.options(
        f"{trusted_server.url}/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
        timeout=10,
    )
    assert pre.status_code in (200, 204)
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert set(pre.headers["access-control-allow-methods"].replace(" ", "").split(",")) == {
        "GET",
        "POST",
    }
    r = httpx.get(f"{trusted_server.url}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
    assert r.headers["access-control-allow-origin"] == ORIGIN
    evil = httpx.get(
        f"{trusted_server.url}/v1/models", headers={"Origin": "https://evil.example"}, timeout=10
    )
    assert "access-control-allow-origin" not in evil.headers


# -- HTTPS -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A CA of the test's own, a server certificate for 127.0.0.1, a client certificate."""
    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1", "localhost")
    client_cert = ca.issue_cert("client@flowllm.test")
    d = tmp_path_factory.mktemp("pki")
    server_cert.private_key_pem.write_to_path(str(d / "server.key"))
    with (d / "server.pem").open("wb") as f:
        for blob in server_cert.cert_chain_pems:
            f.write(blob.bytes())
    ca.cert_pem.write_to_path(str(d / "ca.pem"))
    return {"ca": ca, "client": client_cert, "dir": d}


def _context(pki: dict[str, Any], *, client_cert: bool) -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    pki["ca"].configure_trust(ctx)
    if client_cert:
        pki["client"].configure_cert(ctx)
    return ctx


def _tls_flags(pki: dict[str, Any]) -> list[str]:
    d = pki["dir"]
    return ["--ssl-keyfile", str(d / "server.key"), "--ssl-certfile", str(d / "server.pem")]


def test_https_with_the_openai_sdk(gpt2_tiny_dir: Path, pki: dict[str, Any]) -> None:
    ctx = _context(pki, client_cert=False)
    proc = start_server(str(gpt2_tiny_dir), [*TINY_FLAGS, *_tls_flags(pki)], tls=ctx)
    try:
        assert proc.url.startswith("https://")
        client = proc.client(http_client=httpx.Client(verify=ctx, timeout=60))
        out = client.completions.create(model=proc.model, prompt="Hello", max_tokens=3)
        assert out.usage is not None and out.usage.completion_tokens == 3
        # A client that does not trust the test CA refuses the server's certificate.
        with pytest.raises(openai.APIConnectionError):
            proc.client(http_client=httpx.Client(timeout=10)).models.list()
        # And plain HTTP is not served on the port.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{proc.port}/health", timeout=10)
    finally:
        proc.stop()


def test_mutual_tls_requires_a_client_certificate(
    gpt2_tiny_dir: Path, pki: dict[str, Any]
) -> None:
    with_cert = _context(pki, client_cert=True)
    flags = [
        *TINY_FLAGS, *_tls_flags(pki),
        "--ssl-ca-certs", str(pki["dir"] / "ca.pem"),
        "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)),
    ]  # fmt: skip
    proc = start_server(str(gpt2_tiny_dir), flags, tls=with_cert)
    try:
        without = _context(pki, client_cert=False)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{proc.url}/health", verify=without, timeout=10)
        with pytest.raises(openai.APIConnectionError):
            proc.client(http_client=httpx.Client(verify=without, timeout=10)).models.list()
        client = proc.client(http_client=httpx.Client(verify=with_cert, timeout=60))
        stream = client.completions.create(
            model=proc.model, prompt="Hello", max_tokens=3, stream=True
        )
        assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].text) >= 1
    finally:
        proc.stop()


# -- OpenAPI -----------------------------------------------------------------------------


def test_openapi_and_docs(server: ServerProcess) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == {r for r in served_routes() if r[1] not in ("/openapi.json", "/docs")}
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    schema = {**chat["application/json"]["schema"], "components": doc["components"]}
    jsonschema.Draft202012Validator(schema).validate({"messages": MESSAGES, "cache_salt": "x"})
    docs = httpx.get(f"{server.url}/docs", timeout=10)
    assert docs.status_code == 200 and "SwaggerUIBundle" in docs.text


# -- cache_salt --------------------------------------------------------------------------


def test_cache_salt_isolates_prefix_hits(server: ServerProcess) -> None:
    """Only a request with the same salt hits the blocks a salted request cached."""
    prompt = " ".join(uuid.uuid4().hex for _ in range(8))  # 64+ tokens no other test sends
    name = "flowllm:prefix_cache_hits_total"

    def hits() -> float:
        return server.metrics().get(name, 0.0)

    def send(salt: str | None) -> None:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        assert _post(server, "/v1/completions", body).status_code == 200

    start = hits()
    send("tenant-a")
    send("tenant-b")
    send(None)
    time.sleep(0.5)
    assert hits() == start  # neither another salt nor no salt hit tenant-a's blocks
    send("tenant-a")
    assert wait_until(lambda: hits() > start)
    gained = hits() - start
    send(None)  # the unsalted copy from the third request
    assert wait_until(lambda: hits() - start >= 2 * gained)
    assert gained % 16 == 0  # whole blocks of the default block size
