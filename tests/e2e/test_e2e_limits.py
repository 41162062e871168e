"""Requests that used to break `flowllm serve` with the bundled model: each one is now a
4xx OpenAI error naming the right `param`, answered within a second, and the server keeps
serving (a normal request and /health afterwards)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_process import ServerProcess, process_tree

HUGE = "9" * 400
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "Hi", "max_tokens": 4}


def raw(fields: dict[str, Any], extra: str) -> bytes:
    """A JSON body of `fields` with `extra` (raw JSON members) spliced in."""
    body = httpx.Request("POST", "http://x", json=fields).content
    return body[:-1] + b", " + extra.encode() + b"}"


# (path, body, expected param)
CASES: list[tuple[str, bytes, str | None]] = [
    ("/v1/completions", raw(COMPLETION, '"logprobs": 1' + "0" * 400), "logprobs"),
    ("/v1/completions", raw(COMPLETION, '"n": -' + HUGE), "n"),
    ("/v1/completions", raw({"prompt": "Hi"}, '"max_tokens": ' + HUGE), "max_tokens"),
    ("/v1/completions", raw(COMPLETION, '"min_tokens": ' + HUGE), "min_tokens"),
    (
        "/v1/chat/completions",
        raw({**CHAT, "logprobs": True}, '"top_logprobs": ' + HUGE),
        "top_logprobs",
    ),
    (
        "/v1/completions",
        raw(COMPLETION, '"stop_token_ids": [9223372036854775808]'),
        "stop_token_ids",
    ),
    ("/v1/completions", raw(COMPLETION, '"logit_bias": {"9223372036854775808": 1}'), "logit_bias"),
    (
        "/v1/chat/completions",
        raw({**CHAT, "chat_template": '{{ raise_exception("x") }}'}, '"n": 1'),
        "chat_template",
    ),
    (
        "/v1/chat/completions",
        raw({**CHAT, "chat_template": "{{ a.b.c }}"}, '"n": 1'),
        "chat_template",
    ),
    ("/v1/completions", raw(COMPLETION, '"n": 30000000'), "n"),
    ("/v1/completions", raw({"prompt": ["hi"] * 300, "max_tokens": 1}, '"n": 1'), "prompt"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),
    ("/v1/completions", raw({**COMPLETION, "stop": ["a" * 40_000]}, '"n": 1'), "stop"),
    ("/v1/chat/completions", raw(CHAT, '"tools": [{"type": "function"}]'), "tools"),
    ("/v1/chat/completions", raw(CHAT, '"guided_json": {"type": "nope"}'), "guided_json"),
    ("/v1/completions", raw(COMPLETION, '"guided_regex": "' + "a" * 70_000 + '"'), "guided_regex"),
    (
        "/v1/completions",
        raw(COMPLETION, '"structured_outputs": {"regex": "a", "choice": ["b"]}'),
        "structured_outputs",
    ),
    ("/v1/completions", raw(COMPLETION, '"use_beam_search": true'), "use_beam_search"),
]


def post(server: ServerProcess, path: str, body: bytes) -> tuple[httpx.Response, float]:
    start = time.perf_counter()
    response = httpx.post(
        f"{server.url}{path}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=30,
    )
    return response, time.perf_counter() - start


def assert_still_serving(server: ServerProcess) -> None:
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
    response = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(("path", "body", "param"), CASES, ids=[str(i) for i in range(len(CASES))])
def test_each_breaking_request_is_a_quick_400(
    bundled_server: ServerProcess, path: str, body: bytes, param: str | None
) -> None:
    response, elapsed = post(bundled_server, path, body)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert len(error["message"]) < 500
    assert elapsed < 1.0, f"{elapsed:.2f} s"
    assert_still_serving(bundled_server)


def _fuzzed_bodies(rng: random.Random, count: int) -> list[tuple[str, bytes]]:
    """Bad bodies: huge or odd values in every numeric field, junk types. Later members
    win over the base's `max_tokens: 2`; a body that happens to be valid generates little."""
    fields = [
        "n", "max_tokens", "min_tokens", "logprobs", "top_k", "seed", "temperature", "top_p",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
        "prompt_logprobs",
    ]  # fmt: skip
    values = [
        HUGE, "-" + HUGE, "1e400", "-1e400", "9223372036854775808", "-9223372036854775809",
        "18446744073709551616", "30000000", "-1", "0", '"x"', "[]", "{}",
        "1" + "0" * rng.randint(20, 300),
    ]  # fmt: skip
    bodies = []
    for _ in range(count):
        members = [
            f'"{rng.choice(fields)}": {rng.choice(values)}' for _ in range(rng.randint(1, 4))
        ]
        if rng.random() < 0.2:
            members.append(f'"stop_token_ids": [{rng.choice(values)}]')
        if rng.random() < 0.2:
            members.append(f'"logit_bias": {{"{rng.choice([HUGE, "-1", "99999999"])}": 1}}')
        if rng.random() < 0.5:
            path, base = "/v1/completions", '{"prompt": "Hi", "max_tokens": 2'
        else:
            messages = '[{"role": "user", "content": "Hi"}]'
            path, base = "/v1/chat/completions", f'{{"messages": {messages}, "max_tokens": 2'
        bodies.append((path, (base + ", " + ", ".join(members) + "}").encode()))
    return bodies


def _rss_mib(server: ServerProcess) -> float:
    """The resident memory of the server's processes."""
    total = 0
    for pid in process_tree(server.process.pid):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def test_fuzzed_bad_bodies_never_break_the_server(bundled_server: ServerProcess) -> None:
    rng = random.Random(1234)
    before = _rss_mib(bundled_server)
    statuses: dict[int, int] = {}
    with httpx.Client(timeout=30) as client:
        for path, body in _fuzzed_bodies(rng, 300):
            start = time.perf_counter()
            response = client.post(
                f"{bundled_server.url}{path}",
                content=body,
                headers={"content-type": "application/json"},
            )
            elapsed = time.perf_counter() - start
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code != 500, (body[:200], response.text)
            assert response.status_code < 500 or response.status_code == 503, response.text
            if response.status_code >= 400:
                assert "error" in response.json()
            assert elapsed < 5.0, body[:200]
    assert 400 in statuses
    assert _rss_mib(bundled_server) - before < 500, (before, _rss_mib(bundled_server))
    assert_still_serving(bundled_server)
