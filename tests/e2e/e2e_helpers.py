"""What the end-to-end tests share beyond the server itself (tests/server_process.py):
starting a server, SSE reading, error-body checks, the e2e settings."""

from __future__ import annotations

import json
import os
import ssl
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
from server_process import ServerProcess


def sse_events(response: httpx.Response) -> list[Any]:
    """The JSON payloads of an SSE body, ending with the literal "[DONE]"."""
    events: list[Any] = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response: httpx.Response, status: int, *, code: str | None = None) -> dict:
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}` with `status`."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if code is not None:
        assert error["code"] == code, error
    return error


API_KEY = "e2e-secret-key"
# A minimal ChatML template, so the tiny GPT-2 (which has none) serves chat requests too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FLOOD_MAX_PENDING = 2  # the flood server's ingest admits this many without output


def start_server(
    model: str | None,
    flags: Sequence[str],
    *,
    graph: Path | None = None,
    env: dict[str, str] | None = None,
    tls: ssl.SSLContext | None = None,
) -> ServerProcess:
    """A healthy server, or the server's output in the error (the process is stopped).

    `FLOWLLM_E2E_API_SERVER_COUNT=N` runs every such server with N fronts, so that the
    whole suite checks what `--api-server-count` serves."""
    fronts = os.environ.get("FLOWLLM_E2E_API_SERVER_COUNT")
    if fronts is not None and "--api-server-count" not in flags:
        flags = [*flags, "--api-server-count", fronts]
    server = ServerProcess(model, flags, graph=graph, env=env, tls=tls)
    try:
        return server.wait_healthy()
    except BaseException:
        server.stop()
        raise
