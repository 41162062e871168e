"""examples/graphs/small-queues.yaml: a burst of 200 concurrent requests gets some 503s
(with Retry-After) at once, and every admitted request completes with the right text."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
from example_server import EXAMPLES, MODEL_NAME
from server_process import ServerProcess

from flowllm.graph.validator import load_graph

SMALL_QUEUES_YAML = EXAMPLES / "graphs" / "small-queues.yaml"
BURST = 200
PROMPTS = ["Hello there", "The story begins", "1 2 3", "Once upon a time", "A"]
MAX_TOKENS = 6


def test_small_queues_graph_is_small() -> None:
    graph = load_graph(SMALL_QUEUES_YAML)
    assert graph.stages["ingest"].params.max_pending == 16  # type: ignore[attr-defined]
    assert graph.channels["validate.in"].capacity == 16
    assert max(c.capacity for n, c in graph.channels.items() if n != "validate.in") <= 4


async def _one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, Any]:
    try:
        out = await client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
        )
    except openai.APIStatusError as e:
        return "error", e
    return "ok", out


def test_burst_is_shed_and_the_rest_completes(
    default_server: ServerProcess, start_server: Any
) -> None:
    reference = {}
    for prompt in PROMPTS:
        out = default_server.client().completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0
        )
        reference[prompt] = (out.choices[0].text, out.usage)
    server = start_server(SMALL_QUEUES_YAML)

    async def burst() -> list[tuple[str, Any]]:
        limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
        async with server.async_client(
            http_client=httpx.AsyncClient(limits=limits, timeout=120)
        ) as client:
            return list(
                await asyncio.gather(
                    *(_one(client, PROMPTS[i % len(PROMPTS)]) for i in range(BURST))
                )
            )

    started = time.monotonic()
    results = asyncio.run(burst())
    elapsed = time.monotonic() - started
    ok = [(i, r) for i, (kind, r) in enumerate(results) if kind == "ok"]
    errors = [r for kind, r in results if kind == "error"]
    assert len(ok) + len(errors) == BURST
    assert errors, "no request was shed"
    assert ok, "every request was shed"
    for error in errors:
        assert error.status_code == 503, error
        assert error.response.headers.get("retry-after")
    for i, out in ok:
        text, usage = reference[PROMPTS[i % len(PROMPTS)]]
        assert out.choices[0].text == text
        assert out.choices[0].finish_reason == "length"
        assert out.usage == usage
    # The server is still healthy and serves the next request normally.
    assert httpx.get(server.url + "/health").status_code == 200
    again = server.client().completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0
    )
    assert again.choices[0].text == reference[PROMPTS[0]][0]
    print(f"burst of {BURST}: {len(ok)} served, {len(errors)} shed (503), {elapsed:.1f} s")
