"""/v1/chat/completions on the real engine (tiny GPT-2 with a ChatML `--chat-template`).

Oracles: the server's non-streamed answer, and the prompt the same template renders
through the real tokenizer (`/tokenize` must agree with usage.prompt_tokens).
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest
from e2e_helpers import CHAT_TEMPLATE, sse_events
from server_process import ServerProcess

MESSAGES: list[Any] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


def _chat(server: ServerProcess, **body: Any) -> dict[str, Any]:
    body.setdefault("messages", MESSAGES)
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_prompt_is_the_chat_template(server: ServerProcess, gpt2_tokenizer: Any) -> None:
    result = _chat(server, max_tokens=4, temperature=0)
    rendered = gpt2_tokenizer.apply_chat_template(
        MESSAGES, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False
    )
    expected = len(gpt2_tokenizer.encode(rendered))
    assert result["usage"]["prompt_tokens"] == expected
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, timeout=30)
    assert tokenized.json()["count"] == expected
    assert result["object"] == "chat.completion"
    choice = result["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 4


def test_greedy_stream_equals_whole_sync_sdk(server: ServerProcess) -> None:
    client = server.client()
    whole = client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=20, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason == "length"
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.object == "chat.completion.chunk" for c in chunks)


@pytest.mark.anyio
async def test_greedy_stream_equals_whole_async_sdk(server: ServerProcess) -> None:
    client = server.async_client()
    whole = await client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_completion_tokens=12, temperature=0
    )
    stream = await client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_completion_tokens=12, temperature=0,
        stream=True,
    )  # fmt: skip
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == whole.choices[0].message.content
    await client.close()


def test_logprobs_shapes(server: ServerProcess) -> None:
    result = _chat(server, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = result["choices"][0]["logprobs"]["content"]
    assert len(content) == 5
    assert "".join(e["token"] for e in content) == result["choices"][0]["message"]["content"]
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["logprob"] <= 0
        assert entry["bytes"] == list(entry["token"].encode())
        tops = entry["top_logprobs"]
        assert len(tops) == 3
        assert [set(t) for t in tops] == [{"token", "logprob", "bytes"}] * 3
        values = [t["logprob"] for t in tops]
        assert values == sorted(values, reverse=True)
        assert math.isclose(entry["logprob"], values[0], abs_tol=1e-4)  # greedy picks the top
    without = _chat(server, max_tokens=2, temperature=0, logprobs=True)
    assert all(e["top_logprobs"] == [] for e in without["choices"][0]["logprobs"]["content"])
    assert _chat(server, max_tokens=2)["choices"][0]["logprobs"] is None

    # Streamed: one entry per token, the same values.
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True,
            "top_logprobs": 3, "stream": True}  # fmt: skip
    with httpx.stream(
        "POST", f"{server.url}/v1/chat/completions", json=body, timeout=60
    ) as response:
        events = sse_events(response)[:-1]
    streamed = [
        e
        for ev in events
        for c in ev["choices"]
        if c.get("logprobs")
        for e in c["logprobs"]["content"]
    ]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content])


def test_n_and_seed(server: ServerProcess) -> None:
    client = server.client()
    kwargs: dict[str, Any] = {
        "model": server.model, "messages": MESSAGES, "max_tokens": 10, "n": 2, "seed": 99,
        "temperature": 1.0,
    }  # fmt: skip
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert texts[0] != texts[1]
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[0], streamed[1]] == texts


def test_stop_string(server: ServerProcess) -> None:
    request = {"max_tokens": 24, "temperature": 1.0, "seed": 3}
    text = _chat(server, **request)["choices"][0]["message"]["content"]
    assert len(text) > 20, text
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    cut = text.index(stop)
    choice = _chat(server, **request, stop=stop)["choices"][0]
    assert choice["message"]["content"] == text[:cut]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", stop)


def test_content_parts_and_max_completion_tokens(server: ServerProcess) -> None:
    plain = _chat(server, max_tokens=6, temperature=0)
    parts = _chat(
        server,
        messages=[
            MESSAGES[0],
            {"role": "user", "content": [{"type": "text", "text": MESSAGES[1]["content"]}]},
        ],
        max_completion_tokens=6,
        max_tokens=99,  # max_completion_tokens wins
        temperature=0,
        user="someone",
        response_format={"type": "text"},
    )
    assert parts["choices"][0]["message"] == plain["choices"][0]["message"]
    assert parts["usage"] == plain["usage"]
