"""A small OpenAI-shaped HTTP server for the load generator's end-to-end tests.

Plain asyncio streams in a background thread on 127.0.0.1: HTTP/1.1 with keep-alive, SSE
sent with chunked transfer encoding, known delays before the first token and between
tokens, and switchable failures (HTTP 500, an error event mid-stream, a request that never
finishes, strict field checking like `transformers serve`). It "tokenizes" by whitespace:
a prompt's usage is its word count, so token totals are known exactly.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import msgspec

# Fields a strict server accepts (transformers serve refuses anything else with 422).
STRICT_FIELDS = frozenset(
    {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "stream"}
    | {"stream_options", "temperature", "seed"}
)


class ServerBehaviour(msgspec.Struct, kw_only=True):
    """How the fake server answers; requests are numbered from 1 in arrival order."""

    ttft_s: float = 0.05  # delay before the first token
    itl_s: float = 0.01  # delay between tokens
    send_usage: bool = True
    fail_every: int = 0  # every k-th request gets HTTP 500
    error_event_every: int = 0  # every k-th request gets an error event after one token
    hang_every: int = 0  # every k-th request sends one token and never finishes
    strict: bool = False  # reject unknown body fields with 422
    model_id: str = "fake-model"


class FakeOpenAIServer:
    """Serves /v1/models, /v1/completions and /v1/chat/completions on a free loopback port."""

    def __init__(self, behaviour: ServerBehaviour) -> None:
        self.behaviour = behaviour
        self.requests: list[dict[str, Any]] = []  # {"path", "headers", "body"} per POST
        self.inflight = 0
        self.max_inflight = 0
        self.port = 0
        self._count = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fake server did not start")

    def stop(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._on_connection, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        await self._stop.wait()
        server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await server.wait_closed()

    async def _on_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                request_line = await reader.readline()
                if not request_line:
                    break
                method, path, _ = request_line.decode().split(" ", 2)
                headers: dict[str, str] = {}
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b"\n", b""):
                        break
                    key, value = line.decode().split(":", 1)
                    headers[key.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                await self._respond(method, path, headers, body, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _send_json(self, writer: asyncio.StreamWriter, status: int, obj: object) -> None:
        payload = json.dumps(obj).encode()
        reason = {200: "OK", 404: "Not Found", 422: "Unprocessable", 500: "Server Error"}[status]
        writer.write(
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()

    async def _send_event(self, writer: asyncio.StreamWriter, obj: object) -> None:
        data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
        writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        await writer.drain()

    async def _respond(
        self,
        method: str,
        path: str,
        headers: dict[str, str],
        raw: bytes,
        writer: asyncio.StreamWriter,
    ) -> None:
        b = self.behaviour
        if method == "GET" and path == "/v1/models":
            await self._send_json(writer, 200, {"object": "list", "data": [{"id": b.model_id}]})
            return
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            await self._send_json(writer, 404, {"error": {"message": f"no route {path}"}})
            return
        body = json.loads(raw)
        self.requests.append({"path": path, "headers": headers, "body": body})
        self._count += 1
        number = self._count
        if b.strict and set(body) - STRICT_FIELDS:
            fields = sorted(set(body) - STRICT_FIELDS)
            await self._send_json(writer, 422, {"detail": f"Unexpected fields: {fields}"})
            return
        if b.fail_every and number % b.fail_every == 0:
            await self._send_json(writer, 500, {"error": {"message": "simulated overload"}})
            return

        chat = path.endswith("chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            # An empty first event (the role, for chat): it must not count as the first token.
            if chat:
                first: dict[str, Any] = {"delta": {"role": "assistant", "content": ""}}
            else:
                first = {"text": ""}
            await self._send_event(writer, {"choices": [{"index": 0, **first}]})
            await asyncio.sleep(b.ttft_s)
            for i in range(max_tokens):
                if i > 0:
                    await asyncio.sleep(b.itl_s)
                piece = f" w{i}"
                choice = {"delta": {"content": piece}} if chat else {"text": piece}
                await self._send_event(writer, {"choices": [{"index": 0, **choice}]})
                if b.error_event_every and number % b.error_event_every == 0:
                    await self._send_event(writer, {"error": {"message": "simulated engine fault"}})
                    break
                if b.hang_every and number % b.hang_every == 0:
                    await asyncio.sleep(3600)
            else:
                usage = {
                    "prompt_tokens": len(prompt.split()),
                    "completion_tokens": max_tokens,
                    "total_tokens": len(prompt.split()) + max_tokens,
                }
                if b.send_usage:
                    await self._send_event(writer, {"choices": [], "usage": usage})
            await self._send_event(writer, b"[DONE]")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            self.inflight -= 1
