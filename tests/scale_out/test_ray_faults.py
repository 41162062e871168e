"""A replica process killed under load: its in-flight requests get an error, the other
replica's finish, nothing hangs, new requests succeed within 30 s, /health says degraded
while Ray restarts the replica, and the restarted replica serves again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import httpx
import pytest
from ray_helpers import labelled, replica_pid
from server_process import ServerProcess, wait_until

# Long enough to be in flight when the replica dies; the shared text routes them together.
SHARED = "In the beginning the universe was created. This has made a lot of people angry. " * 2
BODY = {"max_tokens": 400, "ignore_eos": True, "temperature": 0, "stream": True}
RESUME_S = 30.0


async def _stream(client: httpx.AsyncClient, prompt: str, first: asyncio.Event) -> dict[str, Any]:
    """Read one stream to its end: its text events, and the error event if one came."""
    result: dict[str, Any] = {"events": 0, "error": None, "finish": None}
    async with client.stream("POST", "/v1/completions", json={**BODY, "prompt": prompt}) as r:
        result["status"] = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                result["error"] = event["error"]
                continue
            result["events"] += 1
            result["finish"] = event["choices"][0]["finish_reason"] or result["finish"]
            first.set()
    return result


@pytest.mark.anyio
async def test_killed_replica_fails_only_its_requests_and_service_resumes(
    own_cluster_server: ServerProcess,
) -> None:
    server = own_cluster_server
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
        # Three streams with one prefix land on one replica; the fourth, with the others'
        # replica busier, on the other one (the less loaded of the two).
        starts = [asyncio.Event() for _ in range(4)]
        prompts = [SHARED + f"Chapter {i}." for i in range(3)] + ["Something else entirely."]
        tasks = []
        for prompt, started in zip(prompts, starts, strict=True):
            tasks.append(asyncio.create_task(_stream(client, prompt, started)))
            await asyncio.wait_for(started.wait(), 30)
        in_flight = labelled(server, "flowllm:replica_in_flight_requests", "replica")
        assert sorted(in_flight.values()) == [1.0, 3.0], in_flight
        victim = next(r for r, n in in_flight.items() if n == 3.0)
        pid = await asyncio.to_thread(replica_pid, server, f"engine-{victim}")
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()

        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)  # nothing hangs
        for result in results[:3]:  # the victim's: an OpenAI error event, mid-stream
            assert result["status"] == 200 and result["error"] is not None, result
            assert result["error"]["code"] == "replica_failed"
            assert result["finish"] is None
        assert results[3]["error"] is None and results[3]["finish"] == "length", results[3]

        health = await client.get("/health")
        assert health.status_code == 200 and health.text.startswith("degraded"), health.text

        # New requests succeed (on the healthy replica) within 30 s of the kill.
        async def served() -> bool:
            r = await client.post(
                "/v1/completions", json={"prompt": SHARED, "max_tokens": 4}, timeout=30
            )
            return r.status_code == 200

        while not await served():
            assert time.monotonic() - killed_at < RESUME_S
        oks = await asyncio.gather(*(served() for _ in range(4)))
        assert all(oks)
        assert time.monotonic() - killed_at < RESUME_S

    # Ray restarts the replica (a new process); /health is whole again.
    def restarted() -> bool:
        response = httpx.get(f"{server.url}/health", timeout=10)
        return response.status_code == 200 and response.text == ""

    assert await asyncio.to_thread(wait_until, restarted, 90.0)
    assert await asyncio.to_thread(replica_pid, server, f"engine-{victim}") != pid
