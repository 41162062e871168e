"""The server under load and abuse: clients that leave mid-request, 64 concurrent streams,
and a flood against a small admission limit."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
from e2e_helpers import FLOOD_MAX_PENDING, assert_error
from server_process import ServerProcess, wait_until

RUNNING = "flowllm:num_requests_running"
KV_USAGE = "flowllm:kv_cache_usage_perc"
LONG = {"prompt": "Tell me a long story.", "max_tokens": 480, "ignore_eos": True}


def _idle(server: ServerProcess) -> bool:
    metrics = server.metrics()
    return metrics[RUNNING] == 0 and metrics[KV_USAGE] == 0


def _assert_freed_within_a_second(server: ServerProcess) -> None:
    start = time.monotonic()
    freed = wait_until(lambda: _idle(server), timeout=1.0)
    metrics = server.metrics()
    assert freed, (
        f"after {time.monotonic() - start:.2f} s: {metrics[RUNNING]=} {metrics[KV_USAGE]=}"
    )


def test_stream_disconnect_frees_everything(server: ServerProcess) -> None:
    assert wait_until(lambda: _idle(server), timeout=10)
    with httpx.Client(timeout=60) as client:
        body = {**LONG, "stream": True}
        with client.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            events = 0
            for line in lines:
                if line.startswith("data: "):
                    events += 1
                    if events == 3:
                        break
            # Mid-stream: the request holds a running slot and KV blocks.
            metrics = server.metrics()
            assert metrics[RUNNING] == 1 and metrics[KV_USAGE] > 0, metrics
        # Leaving the `with` closes the connection with the stream unfinished.
    _assert_freed_within_a_second(server)


@pytest.mark.anyio
async def test_async_sdk_stream_abandoned_frees_everything(server: ServerProcess) -> None:
    client = server.async_client()
    stream = await client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Go on and on."}],
        max_tokens=480,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    async for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 3:
            break
    await stream.close()
    await client.close()
    await asyncio.to_thread(_assert_freed_within_a_second, server)


def test_non_streaming_client_timeout_frees_everything(server: ServerProcess) -> None:
    assert wait_until(lambda: _idle(server), timeout=10)
    # 16 choices of 480 tokens take far longer than the client waits, on any machine.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json={**LONG, "n": 16}, timeout=0.1)
    _assert_freed_within_a_second(server)


@pytest.mark.anyio
async def test_64_concurrent_streams_complete(server: ServerProcess) -> None:
    prompts = [f"Client number {i} says" for i in range(8)]
    client = server.async_client()
    references = [
        (await client.completions.create(
            model=server.model, prompt=p, max_tokens=16, temperature=0
        )).choices[0].text
        for p in prompts
    ]  # fmt: skip

    async def one(i: int) -> tuple[int, str, Any, Any]:
        stream = await client.completions.create(
            model=server.model,
            prompt=prompts[i % 8],
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return i, text, finish, usage

    started = time.monotonic()
    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(64))), timeout=90)
    elapsed = time.monotonic() - started
    await client.close()
    assert len(results) == 64
    for i, text, finish, usage in results:
        assert finish == "length"
        assert usage is not None and usage.completion_tokens == 16
        assert text == references[i % 8], (i, text, references[i % 8])
    assert elapsed < 90
    metrics = await asyncio.to_thread(idle_metrics, server)
    assert metrics[RUNNING] == 0


def idle_metrics(server: ServerProcess) -> dict[str, float]:
    wait_until(lambda: _idle(server), timeout=5)
    return server.metrics()


@pytest.mark.anyio
async def test_flood_gets_503_with_retry_after(flood_server: ServerProcess) -> None:
    """Far more requests at once than `max_pending` admits: the excess is refused at once
    with 503 + Retry-After, and every admitted request completes."""
    burst = 40
    body = {"prompt": "Flood", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    limits = httpx.Limits(max_connections=burst, max_keepalive_connections=burst)
    async with httpx.AsyncClient(base_url=flood_server.url, timeout=60, limits=limits) as client:
        reference = await client.post("/v1/completions", json=body)
        assert reference.status_code == 200

        async def one() -> tuple[httpx.Response, float]:
            t0 = time.monotonic()
            response = await client.post("/v1/completions", json=body)
            return response, time.monotonic() - t0

        results = await asyncio.gather(*(one() for _ in range(burst)))
    ok = [r for r, _ in results if r.status_code == 200]
    refused = [(r, t) for r, t in results if r.status_code == 503]
    assert len(ok) + len(refused) == burst, [r.status_code for r, _ in results]
    assert len(ok) >= FLOOD_MAX_PENDING
    assert len(refused) >= burst // 2, f"only {len(refused)} of {burst} refused"
    for response, _ in refused:
        error = assert_error(response, 503, code="server_overloaded")
        assert error["type"] == "ServiceUnavailableError"
        assert int(response.headers["retry-after"]) >= 1
    # Refusals are immediate, not queued behind the admitted work.
    slowest_ok = max(t for r, t in results if r.status_code == 200)
    assert min(t for _, t in refused) < slowest_ok
    for response in ok:
        assert response.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
        assert response.json()["usage"]["completion_tokens"] == 24
    # The server is still healthy and serving afterwards, with nothing left behind.
    assert httpx.get(f"{flood_server.url}/health", timeout=10).status_code == 200
    assert wait_until(lambda: _idle(flood_server), timeout=5)
