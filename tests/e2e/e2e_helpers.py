"""What the end-to-end tests share: the `flowllm serve` subprocess, clients, SSE reading."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import openai

from flowllm.config import BUNDLED_MODEL


def sync_client(url: str, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


def async_client(url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


def sse_events(response: httpx.Response) -> list[Any]:
    """The JSON payloads of an SSE body, ending with the literal "[DONE]"."""
    events: list[Any] = []
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


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


REPO = Path(__file__).resolve().parents[2]
DEFAULT_GRAPH = REPO / "flowllm" / "graph" / "default.yaml"
API_KEY = "e2e-secret-key"
# The server flags every tiny-model server shares (the task's standard e2e settings).
BASE_FLAGS = ("--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "64MiB")
# A minimal ChatML template, so the tiny GPT-2 (which has none) serves chat requests too.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
FLOOD_MAX_PENDING = 2  # the flood server's ingest admits this many without output
STARTUP_TIMEOUT = 120.0  # seconds; the machines are shared, loading may be slow


class ServerStartError(RuntimeError):
    """`flowllm serve` exited or never answered /health; carries its stderr."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """One `python -m flowllm serve` subprocess, its URL and its captured output."""

    def __init__(
        self, model: str | None, flags: Sequence[str], *, env: dict[str, str] | None = None
    ) -> None:
        """`model` None: no model argument, so the server's default (the bundled model)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = model if model is not None else BUNDLED_MODEL
        # stderr goes to a file, not a pipe: a chatty server must never block on a full pipe.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in stop()
            prefix="flowllm-e2e-", suffix=".log", delete=False
        )
        cmd = [
            sys.executable, "-m", "flowllm", "serve", *([model] if model is not None else []),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--log-level", "warning", "--shutdown-timeout", "5", *flags,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env={**os.environ, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        return Path(self._log.name).read_text(errors="replace")

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"flowllm serve exited with {self.proc.returncode}:\n{self.output()}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise ServerStartError(f"flowllm serve not healthy after {timeout} s:\n{self.output()}")

    def stop(self) -> None:
        """SIGTERM (a graceful drain), then SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of /metrics, by name (`flowllm:kv_cache_usage_perc`...)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            match = re.fullmatch(r"([A-Za-z_:][A-Za-z0-9_:]*) (\S+)", line)
            if match:
                values[match.group(1)] = float(match.group(2))
        return values


def start_server(
    model: str | None, flags: Sequence[str], *, env: dict[str, str] | None = None
) -> ServerProcess:
    server = ServerProcess(model, flags, env=env)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    return server
