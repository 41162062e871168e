"""Request bodies and the reading of OpenAI-shaped events, without a network."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import httpx
import pytest

from flowllm.bench.client import (
    api_root,
    build_body,
    endpoint_url,
    error_message,
    event_text,
    send_request,
    sse_lines,
)
from flowllm.bench.prompts import Prompt

PROMPT = Prompt(text="hello there", prompt_len=2, output_len=7)


def test_urls_join_once() -> None:
    for base in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert api_root(base) == "http://h:1"
    assert endpoint_url("http://h:1/v1", "chat") == "http://h:1/v1/chat/completions"
    assert endpoint_url("http://h:1", "completions") == "http://h:1/v1/completions"


def test_bodies() -> None:
    assert build_body("completions", "m", PROMPT, ignore_eos=True, extra_body={}) == {
        "model": "m",
        "stream": True,
        "prompt": "hello there",
        "max_tokens": 7,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    chat = build_body("chat", "m", PROMPT, ignore_eos=False, extra_body={"max_tokens": 3})
    assert "ignore_eos" not in chat
    assert chat["messages"] == [{"role": "user", "content": "hello there"}]
    assert chat["max_completion_tokens"] == 7 and chat["max_tokens"] == 3


def test_event_text_and_errors() -> None:
    assert event_text({"choices": [{"text": "a"}]}, "completions") == "a"
    assert event_text({"choices": [], "usage": {}}, "completions") == ""
    assert event_text({"choices": [{"delta": {"role": "assistant"}}]}, "chat") == ""
    assert event_text({"choices": [{"delta": {"content": "b"}}]}, "chat") == "b"
    assert event_text({"choices": [{"delta": {"reasoning_content": "r"}}]}, "chat") == "r"
    assert error_message({"error": {"message": "bad", "code": 400}}) == "bad"
    assert error_message({"detail": "Unexpected fields"}) == "Unexpected fields"
    assert error_message({"choices": []}) is None


def _record(handler: httpx.MockTransport, endpoint: str = "completions"):  # -> RequestRecord
    async def go():  # -> RequestRecord
        async with httpx.AsyncClient(transport=handler) as client:
            return await send_request(
                client,
                "http://x/v1/" + endpoint,
                build_body(endpoint, "m", PROMPT, ignore_eos=True, extra_body={}),  # type: ignore[arg-type]
                endpoint=endpoint,  # type: ignore[arg-type]
                index=0,
                prompt_len=2,
                timeout_s=5.0,
                t0=0.0,
            )

    return anyio.run(go)


def test_a_plain_json_answer_counts_as_one_event() -> None:
    body = {
        "choices": [{"message": {"role": "assistant", "content": "all at once"}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3},
    }
    record = _record(httpx.MockTransport(lambda _: httpx.Response(200, json=body)), "chat")
    assert record.success and record.generated_text == "all at once"
    assert (record.prompt_tokens, record.output_tokens, record.itl_s) == (4, 3, [])
    assert record.ttft_s is not None


@pytest.mark.parametrize(
    ("response", "error"),
    [
        (httpx.Response(503, text="<html>busy</html>"), "HTTP 503: <html>busy</html>"),
        (httpx.Response(400, json={"error": {"message": "too long"}}), "HTTP 400: too long"),
        (
            httpx.Response(200, text="data: {not json\n\n", headers={"content-type": "text/plain"}),
            "malformed SSE data: '{not json'",
        ),
    ],
)
def test_failures_become_records(response: httpx.Response, error: str) -> None:
    record = _record(httpx.MockTransport(lambda _: response))
    assert not record.success and record.error == error


def test_without_usage_output_tokens_are_the_text_events() -> None:
    sse = "".join(f'data: {{"choices": [{{"text": "t{i}"}}]}}\n\n' for i in range(4))
    response = httpx.Response(200, text=sse + "data: [DONE]\n\n")
    record = _record(httpx.MockTransport(lambda _: response))
    assert record.success and record.output_tokens == 4 and len(record.itl_s) == 3
    assert (record.prompt_tokens, record.prompt_tokens_from_server) == (2, False)


def test_sse_lines_split_only_where_sse_ends_lines() -> None:
    """CRLF, LF and CR end lines (also across chunk boundaries); U+2028 and NEL do not."""

    async def chunks() -> AsyncIterator[str]:
        for piece in ('data: {"t": "a\u2028b\x85c"}\r', "\ndata: 2\n\nda", "ta: 3\rdata: 4"):
            yield piece

    async def read() -> list[str]:
        return [line async for line in sse_lines(chunks())]

    lines = anyio.run(read)
    assert [line for line in lines if line] == [
        'data: {"t": "a\u2028b\x85c"}',
        "data: 2",
        "data: 3",
        "data: 4",
    ]
