"""The ingress's engine client over scripted replica handles (no Ray): what a replica's
stream carries reaches the mailboxes, refusals and deaths become the API's errors, and
aborts reach the replica."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from flowllm.config import RequestLimits
from flowllm.mailbox import RequestFailed
from flowllm.messages import Chunk, GenerateRequest, SamplingParams
from flowllm.scale_out.routed_engine import RoutedEngine
from flowllm.scale_out.wire import ChunkEvent, Event, Refused, decode_submission, encode_event

pytestmark = pytest.mark.anyio


class Stream:
    """A replica's `generate` stream: `script(requests)` gives its events; `hold` keeps it
    open after them until it is cancelled, `die` raises as a dead actor's stream does."""

    def __init__(self, events: list[Event], *, hold: bool = False, die: bool = False) -> None:
        self.events = events
        self.hold = hold
        self.die = die
        self.cancelled = anyio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield encode_event(event)
        if self.die:
            raise RuntimeError("the actor died")
        if self.hold:
            await self.cancelled.wait()
            raise RuntimeError("cancelled")


class Method:
    def __init__(self, call: Callable[..., Any]) -> None:
        self.remote = call


class Handle:
    """One replica: `script(requests)` makes the Stream its next generate call returns;
    a `down` one fails its probes."""

    def __init__(
        self, script: Callable[[list[GenerateRequest]], Stream], *, down: bool = False
    ) -> None:
        self.streams: list[Stream] = []
        self.aborted: list[str] = []

        def generate(payload: bytes) -> Stream:
            self.streams.append(script(decode_submission(payload)))
            return self.streams[-1]

        async def describe() -> dict[str, Any]:
            return {"model_name": "m", "max_model_len": 64, "num_blocks": 8, "block_size": 4}

        async def probe() -> dict[str, Any]:
            if down:  # a dead actor's calls fail until Ray has started a new one
                raise RuntimeError("the actor died")
            return {"healthy": True, "pid": 1, "metrics": b""}

        self.generate = Method(generate)
        self.abort = Method(self.aborted.append)
        self.describe = Method(describe)
        self.probe = Method(probe)

    def options(self, stream: bool) -> Handle:
        return self


def _request(request_id: str, n: int = 1) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id,
        model="m",
        params=SamplingParams(n=n),
        arrival_time=time.monotonic(),
        prompt=f"prompt of {request_id}",
    )


def _finished(request: GenerateRequest, text: str) -> ChunkEvent:
    return ChunkEvent(
        Chunk(
            request_id=request.request_id,
            index=0,
            text=text,
            token_ids=(1,),
            finish_reason="length",
        )
    )


def _engine(handles: list[Handle]) -> Any:
    return RoutedEngine.start(
        [(f"engine-{i}", h) for i, h in enumerate(handles)],
        routing="round_robin",
        imbalance_bound=8,
        tokenizer=None,
        limits=RequestLimits(),
    )


async def test_chunks_reach_the_mailboxes() -> None:
    handle = Handle(lambda requests: Stream([_finished(r, r.request_id) for r in requests]))
    async with _engine([handle]) as engine:
        boxes = engine.submit_all([_request("a"), _request("b")])
        texts = []
        for box in boxes:
            texts.append([chunk.text async for chunk in box])
        assert texts == [["a"], ["b"]]
        assert engine.links[0].in_flight == 0


async def test_a_refusal_is_the_single_servers_503() -> None:
    handle = Handle(lambda requests: Stream([Refused(retry_after=1.0)]))
    async with _engine([handle]) as engine:
        (box,) = engine.submit_all([_request("a")])
        with pytest.raises(RequestFailed) as failed:
            await box.__anext__()
        assert (failed.value.error.kind, failed.value.error.code) == (
            "unavailable", "server_overloaded",
        )  # fmt: skip
        assert failed.value.error.request_id == "a"


async def test_a_dead_replica_fails_its_requests_and_leaves_routing() -> None:
    dead = Handle(lambda requests: Stream([], die=True), down=True)
    alive = Handle(lambda requests: Stream([_finished(r, "ok") for r in requests]))
    async with _engine([dead, alive]) as engine:
        (box,) = engine.submit_all([_request("a")])  # round robin: replica 0 first
        with pytest.raises(RequestFailed) as failed:
            await box.__anext__()
        assert (failed.value.error.kind, failed.value.error.code) == (
            "unavailable", "replica_failed",
        )  # fmt: skip
        assert engine.healthy and engine.health_detail.startswith("degraded: 1 of 2")
        for name in "bcd":  # all to the replica that serves
            (box,) = engine.submit_all([_request(name)])
            assert [c.text async for c in box] == ["ok"]
        assert len(dead.streams) == 1 and len(alive.streams) == 3


async def test_aborts_reach_the_replica() -> None:
    handle = Handle(lambda requests: Stream([], hold=True))
    async with _engine([handle]) as engine:
        boxes = engine.submit_all([_request("a"), _request("b")])
        engine.abort("a")  # one of two sub-requests: aborted by name
        assert handle.aborted == ["a"] and not handle.streams[0].cancelled.is_set()
        engine.abort("b")  # none left: the whole stream is cancelled
        assert handle.streams[0].cancelled.is_set()
        with anyio.fail_after(5):
            while engine.links[0].in_flight:
                await anyio.sleep(0.01)
        assert all(box.done for box in boxes)
        engine.abort("a")  # unknown by now: ignored
