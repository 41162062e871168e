"""Cost of moving messages through flowllm channels and stage graphs (no model).

    .venv/bin/python benchmarks/channel_overhead.py [--messages N] [--repeats R]

Prints µs per message and messages/s for:
- a raw anyio memory object stream hop (the floor),
- one `Channel` hop (type check, send stamp, taps, queue wait),
- a message through an 8-stage graph (source, 6 relays, sink: 7 hops), with spans off,
  spans on (timing + histograms; span events filtered out at INFO), and spans on with
  every span event rendered as JSON (to a null stream),
- the same 8-stage graph, one message at a time (end-to-end latency, not throughput),
  beside bare anyio streams between 8 tasks measured the same ways (the floor).
The best of R repeats is reported, since the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import io
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import anyio
import msgspec
import structlog

from flowllm.graph.channel import Channel
from flowllm.graph.runtime import Graph
from flowllm.graph.spec import DEFAULT_CAPACITY, EdgeSpec, GraphSpec, PortRef, StageSpec
from flowllm.graph.stage import PerMessageStage, SourceStage, Stage, StageContext


class Msg(msgspec.Struct, frozen=True):
    step_id: int
    seqs: tuple[int, ...] = ()


class CountParams(msgspec.Struct, frozen=True):
    count: int = 0


class Source(Stage):
    outputs: ClassVar[dict[str, Any]] = {"out": Msg}
    Params = CountParams

    async def run(self, ctx: StageContext) -> None:
        emit = ctx.outbox("out").send
        for i in range(self.params.count):
            await emit(Msg(i))


class Relay(PerMessageStage):
    inputs: ClassVar[dict[str, Any]] = {"in": Msg}
    outputs: ClassVar[dict[str, Any]] = {"out": Msg}

    async def handle(self, message: Msg, ctx: StageContext) -> None:
        await ctx.emit("out", message)


class Sink(PerMessageStage):
    inputs: ClassVar[dict[str, Any]] = {"in": Msg}

    def __init__(self, params: Any, services: Any) -> None:
        super().__init__(params, services)
        self.count = 0
        self.arrived: anyio.Event | None = None

    async def handle(self, message: Msg, ctx: StageContext) -> None:
        self.count += 1
        if self.arrived is not None:
            self.arrived.set()


class Pulse(SourceStage):
    """A source the benchmark drives one message at a time."""

    outputs: ClassVar[dict[str, Any]] = {"out": Msg}


def pipeline_spec(stages: int, count: int, source: str) -> GraphSpec:
    mod = __name__
    names = [f"s{i}" for i in range(stages)]
    specs = [StageSpec(names[0], f"{mod}:{source}", {"count": count} if count else {})]
    specs += [StageSpec(n, f"{mod}:Relay") for n in names[1:-1]]
    specs.append(StageSpec(names[-1], f"{mod}:Sink"))
    edges = [
        EdgeSpec(PortRef(a, "out"), PortRef(b, "in"), DEFAULT_CAPACITY)
        for a, b in itertools.pairwise(names)
    ]
    return GraphSpec("bench", tuple(specs), tuple(edges))


async def raw_hop(n: int) -> float:
    return await raw_chain(n, 2)


async def raw_chain(n: int, stages: int) -> float:
    """The floor: bare anyio streams between `stages` tasks (source, relays, sink)."""
    streams = [anyio.create_memory_object_stream[Any](DEFAULT_CAPACITY) for _ in range(stages - 1)]
    messages = [Msg(i) for i in range(n)]

    async def source() -> None:
        async with streams[0][0] as send:
            for message in messages:
                await send.send(message)

    async def relay(k: int) -> None:
        async with streams[k - 1][1] as receive, streams[k][0] as send:
            async for message in receive:
                await send.send(message)

    async def sink() -> None:
        async with streams[-1][1] as receive:
            async for _ in receive:
                pass

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(source)
        for k in range(1, stages - 1):
            tg.start_soon(relay, k)
        tg.start_soon(sink)
    return time.perf_counter() - start


async def raw_chain_latency(n: int, stages: int) -> float:
    """The floor for latency: one message at a time through bare anyio streams."""
    streams = [anyio.create_memory_object_stream[Any](DEFAULT_CAPACITY) for _ in range(stages - 1)]

    async def relay(k: int) -> None:
        async with streams[k - 1][1] as receive, streams[k][0] as send:
            async for message in receive:
                await send.send(message)

    total = 0.0
    async with anyio.create_task_group() as tg:
        for k in range(1, stages - 1):
            tg.start_soon(relay, k)
        send, receive = streams[0][0], streams[-1][1]
        for i in range(n):
            start = time.perf_counter()
            await send.send(Msg(i))
            await receive.receive()
            total += time.perf_counter() - start
        send.close()
    return total


async def channel_hop(n: int) -> float:
    channel: Channel[Msg] = Channel("bench", Msg, DEFAULT_CAPACITY)
    channel.add_tap(lambda message, sent: None)  # a tap costs what the trace recorder's will
    sender, receiver = channel.sender(), channel.receiver()
    channel.close()
    messages = [Msg(i) for i in range(n)]

    async def produce() -> None:
        for message in messages:
            await sender.send(message)
        sender.close()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        async for _ in receiver:
            pass
    return time.perf_counter() - start


def null_logger(level: int) -> Any:
    processors: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.JSONRenderer(),
    ]
    return structlog.wrap_logger(
        structlog.PrintLogger(io.StringIO()),
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
    )


async def graph_throughput(n: int, stages: int, spans: bool, level: int) -> float:
    graph = Graph(pipeline_spec(stages, n, "Source"), spans=spans, logger=null_logger(level))
    start = time.perf_counter()
    await graph.run()
    elapsed = time.perf_counter() - start
    sink = graph.stage(f"s{stages - 1}")
    if not isinstance(sink, Sink) or sink.count != n or graph.failure is not None:
        raise RuntimeError("the pipeline lost messages")
    return elapsed


async def graph_latency(n: int, stages: int) -> float:
    graph = Graph(pipeline_spec(stages, 0, "Pulse"), logger=null_logger(logging.INFO))
    total = 0.0
    async with graph.serve():
        source, sink = graph.stage("s0"), graph.stage(f"s{stages - 1}")
        if not isinstance(sink, Sink):
            raise RuntimeError("unexpected sink")
        for i in range(n):
            sink.arrived = anyio.Event()
            start = time.perf_counter()
            await source.context.emit("out", Msg(i))
            await sink.arrived.wait()
            total += time.perf_counter() - start
    return total


def best(repeats: int, fn: Callable[[], Awaitable[float]]) -> float:
    return min(anyio.run(fn) for _ in range(repeats))


def report(label: str, seconds: float, n: int, hops: int) -> None:
    us = seconds / n * 1e6
    print(f"{label:<52} {us:8.2f} µs/msg {us / hops:7.2f} µs/hop {n / seconds:10,.0f} msg/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n, r = args.messages, args.repeats
    print(f"{n:,} messages per run, best of {r} runs")
    report("raw anyio stream, one hop", best(r, lambda: raw_hop(n)), n, 1)
    report("Channel, one hop (type check, stamp, a tap)", best(r, lambda: channel_hop(n)), n, 1)
    report("raw anyio streams, 8 tasks in a chain", best(r, lambda: raw_chain(n, 8)), n, 7)
    for label, spans, level in (
        ("spans off", False, logging.INFO),
        ("spans on (events filtered at INFO)", True, logging.INFO),
        ("spans on, every event as JSON", True, logging.DEBUG),
    ):
        seconds = best(r, lambda s=spans, lv=level: graph_throughput(n, 8, s, lv))
        report(f"8-stage graph, {label}", seconds, n, 7)
    latency_n = max(n // 20, 100)
    report(
        "raw anyio streams, 8 tasks, one message at a time",
        best(r, lambda: raw_chain_latency(latency_n, 8)),
        latency_n,
        7,
    )
    report(
        "8-stage graph, one message at a time (latency)",
        best(r, lambda: graph_latency(latency_n, 8)),
        latency_n,
        7,
    )


if __name__ == "__main__":
    main()
