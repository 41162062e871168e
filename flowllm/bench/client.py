"""One streamed request to an OpenAI-compatible server, timed event by event.

The client speaks to any server with `/v1/completions` or `/v1/chat/completions` and SSE
streaming (flowllm, vLLM, `transformers serve`). Whatever goes wrong (refused
connection, HTTP error, an error event mid-stream, bad JSON, a timeout) becomes a failed
`RequestRecord` with a message, never an exception: one bad request must not end a run.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import msgspec

from flowllm.bench.args import Endpoint
from flowllm.bench.metrics import RequestRecord
from flowllm.bench.prompts import Prompt

ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
# How much of an error response body is kept in the message.
_ERROR_BODY_CHARS = 200

_json_decoder = msgspec.json.Decoder()


class ServerError(Exception):
    """The server answered, but with an error (status, error event or malformed data)."""


def api_root(base_url: str) -> str:
    """`base_url` without trailing slashes or a trailing `/v1`, so paths join once."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def endpoint_url(base_url: str, endpoint: Endpoint) -> str:
    """The full URL of the chosen endpoint under `base_url`."""
    return api_root(base_url) + ENDPOINT_PATHS[endpoint]


def build_body(
    endpoint: Endpoint,
    model: str,
    prompt: Prompt,
    *,
    ignore_eos: bool,
    extra_body: dict[str, Any],
) -> dict[str, Any]:
    """The JSON body of one streamed request; `extra_body` fields are added last and win.

    `ignore_eos` is a vLLM extension that strict servers reject, so when it is off the field
    is left out rather than sent as false.
    """
    body: dict[str, Any] = {"model": model, "stream": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
        body["max_completion_tokens"] = prompt.output_len
    else:
        body["prompt"] = prompt.text
        body["max_tokens"] = prompt.output_len
    body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body)
    return body


def event_text(data: dict[str, Any], endpoint: Endpoint) -> str:
    """The generated text one streamed event carries ("" for role-only or usage events)."""
    choices = data.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or choice.get("message") or {}
        parts = (delta.get("reasoning_content"), delta.get("reasoning"), delta.get("content"))
        return "".join(p for p in parts if isinstance(p, str))
    text = choice.get("text")
    return text if isinstance(text, str) else ""


def error_message(data: Any) -> str | None:
    """The message of an OpenAI-style error object (`{"error": {...}}`), or None."""
    if not isinstance(data, dict):
        return None
    err = data.get("error")
    if err is None:
        detail = data.get("detail")  # FastAPI-style errors
        return str(detail) if detail is not None and "choices" not in data else None
    if isinstance(err, dict):
        return str(err.get("message") or err)
    return str(err)


def _status_error(status: int, body: bytes) -> str:
    """A short message for a non-200 answer, using the error object when there is one."""
    try:
        message = error_message(_json_decoder.decode(body))
    except msgspec.DecodeError:
        message = None
    if message is None:
        message = body.decode("utf-8", "replace").strip()[:_ERROR_BODY_CHARS]
    return f"HTTP {status}: {message}" if message else f"HTTP {status}"


class _Timing:
    """Timestamps and text of one request as its events arrive (local to one request)."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.ttft: float | None = None
        self.last: float = start
        self.itl: list[float] = []
        self.chunks: list[str] = []
        self.num_events = 0
        self.prompt_tokens: int | None = None
        self.output_tokens: int | None = None

    def on_event(self, data: dict[str, Any], endpoint: Endpoint, now: float) -> None:
        """Account one decoded event received at `now`."""
        message = error_message(data)
        if message is not None:
            raise ServerError(f"error event: {message}")
        text = event_text(data, endpoint)
        if text:
            if self.ttft is None:
                self.ttft = now - self.start
            else:
                self.itl.append(now - self.last)
            self.last = now
            self.num_events += 1
            self.chunks.append(text)
        usage = data.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
            if isinstance(usage.get("completion_tokens"), int):
                self.output_tokens = usage["completion_tokens"]


async def _read_response(response: httpx.Response, endpoint: Endpoint, timing: _Timing) -> None:
    """Consume an SSE stream (or a plain JSON answer from a server that ignored `stream`)."""
    if response.status_code != 200:
        raise ServerError(_status_error(response.status_code, await response.aread()))
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("application/json"):
        data = _json_decoder.decode(await response.aread())
        if not isinstance(data, dict):
            raise ServerError("malformed response: not a JSON object")
        timing.on_event(data, endpoint, time.perf_counter())
        return
    async for line in sse_lines(response.aiter_text()):
        now = time.perf_counter()
        if not line.startswith("data:"):
            continue  # blank separators, comments, `event:` and `id:` fields
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            return
        if not payload:
            continue
        try:
            data = _json_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            raise ServerError(f"malformed SSE data: {payload[:80]!r}") from exc
        if not isinstance(data, dict):
            raise ServerError("malformed SSE data: not a JSON object")
        timing.on_event(data, endpoint, now)


_SSE_LINE_END = re.compile(r"\r\n|\r|\n")


async def sse_lines(texts: AsyncIterator[str]) -> AsyncIterator[str]:
    """Lines as server-sent events define them: ended by CRLF, LF or CR only.

    httpx's `aiter_lines` also ends lines at U+0085, U+2028 and the like, which a server
    may send raw inside a JSON string; splitting there would cut an event in two.
    """
    pending = ""
    async for text in texts:
        *lines, pending = _SSE_LINE_END.split(pending + text)
        for line in lines:
            yield line
    if pending:
        yield pending


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    *,
    endpoint: Endpoint,
    index: int,
    prompt_len: int,
    timeout_s: float,
    t0: float,
    count_tokens: Callable[[str], int] | None = None,
) -> RequestRecord:
    """Send one streamed request and time it; never raises for a failed request.

    `t0` is the benchmark's start (`time.perf_counter()`); `prompt_len` is the local estimate
    of the prompt's tokens and `count_tokens` counts generated tokens, both used only when
    the server reports no `usage`.
    """
    content = msgspec.json.encode(body)
    start = time.perf_counter()
    timing = _Timing(start)
    error: str | None = None
    try:
        with anyio.fail_after(timeout_s):
            async with client.stream(
                "POST", url, content=content, headers={"Content-Type": "application/json"}
            ) as response:
                await _read_response(response, endpoint, timing)
    except TimeoutError:
        error = f"timeout: no complete response within {timeout_s:g} s"
    except ServerError as exc:
        error = str(exc)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        error = f"malformed response: {exc}"
    except Exception as exc:  # a failed request is data, never a crash
        error = f"{type(exc).__name__}: {exc}"
    end = time.perf_counter()

    text = "".join(timing.chunks)
    if timing.output_tokens is not None:
        output_tokens = timing.output_tokens
    elif count_tokens is not None:
        output_tokens = count_tokens(text)
    else:
        output_tokens = timing.num_events
    return RequestRecord(
        index=index,
        success=error is None,
        start_s=start - t0,
        latency_s=end - start,
        ttft_s=timing.ttft,
        itl_s=timing.itl,
        prompt_tokens=timing.prompt_tokens if timing.prompt_tokens is not None else prompt_len,
        output_tokens=output_tokens,
        prompt_tokens_from_server=timing.prompt_tokens is not None,
        output_tokens_from_server=timing.output_tokens is not None,
        generated_text=text,
        error=error,
    )
