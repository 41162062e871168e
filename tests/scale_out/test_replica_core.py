"""An engine replica without Ray: it is an engine core on TCP, running the core's stages
and no other; the front the ingress runs for it runs the rest. Everything that crosses
between them is the cross-process channels' wire (flowllm/graph/wire.py): a recording
proxy cuts each direction into length-prefixed frames itself, and every DATA frame
decodes on its channel's codec, every CONTROL frame as the core protocol. The outputs
are the one-process engine's, token for token; a greeting without the replica's token is
refused; a replica stopped while requests run serves its front until they end."""

from __future__ import annotations

import itertools
import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import pytest
from server_process import TINY_FLAGS

from flowllm.cli import build_parser
from flowllm.engine.args import config_from_args
from flowllm.engine.async_engine import DEFAULT_GRAPH, AsyncEngine
from flowllm.engine.core_protocol import (
    CONTROL_DECODER,
    CoreReady,
    Heartbeat,
    Hello,
    Refused,
)
from flowllm.engine.front import FrontEngine
from flowllm.graph.transport import connect, listen, receive, send_all
from flowllm.graph.validator import ValidGraph, load_graph
from flowllm.graph.wire import (
    CONTROL,
    CREDIT,
    DATA,
    END,
    Frame,
    channel_codecs,
    encode_control,
    read_one_frame,
    wiring_digest,
)
from flowllm.messages import GenerateRequest, SamplingParams
from flowllm.scale_out.replica import EngineReplica

pytestmark = pytest.mark.anyio
TOKEN = "the-replicas-token"
PROMPTS = ["Hello there", "The quick brown fox jumps over", "Once upon a time"]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0),
    SamplingParams(max_tokens=12, temperature=0.9, seed=99, n=2),
    SamplingParams(max_tokens=12, temperature=0.7, top_k=40, seed=5),
]
_ids = itertools.count()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # as Ray's actors run


@pytest.fixture
def args(gpt2_tiny_dir: Path) -> Any:
    argv = ["serve", str(gpt2_tiny_dir), *TINY_FLAGS, "--shutdown-timeout", "5"]
    return build_parser().parse_args(argv)


@asynccontextmanager
async def replica_of(args: Any) -> AsyncIterator[EngineReplica]:
    """The replica as Serve builds it (its async constructor), stopped as Serve stops it."""
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(args, 1, TOKEN)  # type: ignore[misc]
    try:
        yield replica
    finally:
        await replica.__del__()


class Proxy:
    """Forwards one TCP connection to `target`, recording each direction's bytes."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.to_core = bytearray()
        self.to_front = bytearray()

    async def run(self, *, task_status: anyio.abc.TaskStatus[str]) -> None:
        listener, address = await listen("127.0.0.1:0")
        task_status.started(address)
        await listener.serve(self._forward)

    async def _forward(self, front: socket.socket) -> None:
        core = await connect(self.target)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._pump, front, core, self.to_core, tg.cancel_scope)
            tg.start_soon(self._pump, core, front, self.to_front, tg.cancel_scope)

    @staticmethod
    async def _pump(
        source: socket.socket,
        sink: socket.socket,
        record: bytearray,
        scope: anyio.CancelScope,
    ) -> None:
        try:
            while True:
                chunk = await receive(source, 1 << 16)
                record += chunk
                await send_all(sink, chunk)
        except (anyio.EndOfStream, OSError):
            pass
        scope.cancel()
        sink.close()


def frames(data: bytes) -> list[Frame]:
    """`data` cut into frames: a 4-byte little-endian length, then a msgpack frame; every
    byte belongs to one."""
    decoder = msgspec.msgpack.Decoder(Frame)
    found, at = [], 0
    while at < len(data):
        (length,) = struct.unpack_from("<I", data, at)
        assert at + 4 + length <= len(data), "a frame cut short"
        found.append(decoder.decode(data[at + 4 : at + 4 + length]))
        at += 4 + length
    return found


def request(engine: Any, prompt: str, params: SamplingParams) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"r{next(_ids)}",
        model=engine.model_name,
        params=params,
        arrival_time=time.monotonic(),
        prompt=prompt,
    )


async def outputs(engine: Any) -> list[list[tuple[int, ...]]]:
    """Each prompt's choices' token ids, in choice order."""
    boxes = [engine.submit(request(engine, p, s)) for p, s in zip(PROMPTS, PARAMS, strict=True)]
    results = []
    for box in boxes:
        tokens: dict[int, tuple[int, ...]] = {}
        async for chunk in box:
            tokens[chunk.index] = tokens.get(chunk.index, ()) + chunk.token_ids
        results.append([tokens[i] for i in sorted(tokens)])
    return results


def processes(graph: ValidGraph) -> tuple[set[str], set[str]]:
    front = {s for s, p in graph.placement.items() if p == graph.placement["ingest"]}
    return front, set(graph.placement) - front


async def test_the_replica_is_a_core_and_only_the_wire_crosses(args: Any) -> None:
    graph = load_graph(DEFAULT_GRAPH)
    config = config_from_args(args)
    front_stages, core_stages = processes(graph)
    async with AsyncEngine.start(config, graph=graph) as whole:
        assert set(whole.graph.stages_here) == front_stages | core_stages
        expected = await outputs(whole)

    async with replica_of(args) as replica, anyio.create_task_group() as tg:
        described = replica.describe()
        assert set(described["stages"]) == core_stages  # the model's half, no more
        proxy = Proxy(described["address"])
        address = await tg.start(proxy.run)
        async with FrontEngine.connect(config, graph, address, token=TOKEN) as front:
            assert set(front.graph.stages_here) == front_stages
            assert await outputs(front) == expected
            assert await outputs(front) == expected  # the core's cache warm: the same
            assert "flowllm:num_requests_running" in await front.elsewhere()
        tg.cancel_scope.cancel()
        replica.check_health()

    codecs = channel_codecs(graph.channels)
    by_number = {number: (name, codec) for name, (number, codec) in codecs.items()}
    sent: dict[str, set[str]] = {}
    for direction, data in (("to_core", proxy.to_core), ("to_front", proxy.to_front)):
        kinds = sent[direction] = set()
        for frame in frames(bytes(data)):
            if frame.kind == DATA:
                name, codec = by_number[frame.channel]
                receiver = graph.channels[name].dst.stage
                assert (receiver in core_stages) == (direction == "to_core"), name
                kinds.add(type(codec.decode(frame.member, frame.payload)).__name__)
            elif frame.kind == CONTROL:
                kinds.add(type(CONTROL_DECODER.decode(frame.payload)).__name__)
            else:
                assert frame.kind in (CREDIT, END)
    for message in ("Hello", "TokenizedRequest", "MetricsQuery"):
        assert message in sent["to_core"]
    for message in ("CoreReady", "Heartbeat", "StepTokens", "ChoiceEvents", "MetricsReply"):
        assert message in sent["to_front"]


async def test_a_greeting_without_the_token_is_refused(args: Any) -> None:
    graph = load_graph(DEFAULT_GRAPH)
    async with replica_of(args) as replica:
        for token, answer in (("wrong", Refused), (TOKEN, CoreReady)):
            sock = await connect(replica.describe()["address"])
            hello = Hello(front=0, wiring=wiring_digest(graph.channels), pid=1, token=token)
            await send_all(sock, encode_control(hello))
            with anyio.fail_after(10):
                frame = await read_one_frame(sock)
                while isinstance(reply := CONTROL_DECODER.decode(frame.payload), Heartbeat):
                    frame = await read_one_frame(sock)
            assert frame.kind == CONTROL and isinstance(reply, answer), reply
            if isinstance(reply, Refused):
                assert "token" in reply.reason
            sock.close()


async def test_a_stopping_replica_serves_its_front_until_its_requests_end(args: Any) -> None:
    """Serve stops the replica while two requests run: one runs to its end, and the other's
    abort, sent after the stop began, still reaches the core and ends its sequence there
    (a core that stopped taking its front's messages would generate all it asked for)."""
    graph = load_graph(DEFAULT_GRAPH)
    config = config_from_args(args)
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(args, 1, TOKEN)  # type: ignore[misc]
    address = replica.describe()["address"]
    async with FrontEngine.connect(config, graph, address, token=TOKEN) as front:
        finishing = request(front, "Once", SamplingParams(max_tokens=200, ignore_eos=True))
        aborted = request(front, "Twice", SamplingParams(max_tokens=480, ignore_eos=True))
        box, other = front.submit(finishing), front.submit(aborted)
        first = [await box.__anext__(), await other.__anext__()]
        async with anyio.create_task_group() as tg:
            tg.start_soon(replica.__del__)  # Serve stops the replica now
            await anyio.sleep(0.05)
            front.abort(aborted.request_id)
            rest = [chunk async for chunk in box]
    assert sum(len(c.token_ids) for c in [first[0], *rest]) == 200
    assert rest[-1].finish_reason == "length"
    registry = replica._core.services.registry
    generated = registry.get_sample_value("flowllm:generation_tokens_total")
    assert generated is not None and 200 < generated < 200 + 480 / 2, generated
    with pytest.raises(RuntimeError, match="stopped"):
        replica.check_health()
