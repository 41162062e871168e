"""A graph placed across processes: each half runs its own stages, and the edges between
them keep a local channel's contract over a Unix socket (typed, bounded, end of stream,
taps on both sides). The halves run in one event loop here, joined by a real socket, so
each property is checked exactly; tests/e2e runs the default graph in real processes."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from graph_toys import Collect, Other
from test_graph_runtime import quiet_logger

from flowllm.graph import remote
from flowllm.graph.channel import ChannelTypeError
from flowllm.graph.problems import GraphValidationError
from flowllm.graph.remote import Boundary, Peer, PeerGone
from flowllm.graph.runtime import Graph
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import ValidGraph, validate_graph
from flowllm.graph.wire import channel_codecs

FIXTURES = Path(__file__).parent / "fixtures"


def placed(text: str) -> ValidGraph:
    return validate_graph(GraphSpec.from_yaml(text, source="<test>", base_dir=FIXTURES))


PIPELINE = """
stages:
  - {name: source, process: a, use: "graph_toys:Count", with: {count: %(count)d}}
  - {name: relay, process: a, use: "graph_toys:Relay"}
  - {name: sink, process: b, use: "graph_toys:Collect", with: {delay: %(delay)s}}
edges:
  - source.out -> relay.in
  - {from: relay.out, to: sink.in, capacity: %(capacity)d}
"""


def peer(graph: ValidGraph, process: str, undeliverable: list[object] | None = None) -> Peer:
    lost = undeliverable if undeliverable is not None else []
    return Peer(
        process,
        0,
        channel_codecs(graph.channels),
        on_control=lambda _peer, _payload: None,
        undeliverable=lambda _name, message: lost.append(message),
    )


def halves(graph: ValidGraph, services: Any = None) -> tuple[Peer, Peer, Graph, Graph]:
    """Process a's and process b's graphs, and each one's peer for the other."""
    to_b, to_a = peer(graph, "b"), peer(graph, "a")
    half_a = Graph(
        graph, services, process="a", boundary=Boundary({"b": [to_b]}), logger=quiet_logger()
    )
    half_b = Graph(
        graph, services, process="b", boundary=Boundary({"a": [to_a]}), logger=quiet_logger()
    )
    return to_b, to_a, half_a, half_b


async def join(
    to_b: Peer,
    to_a: Peer,
    half_a: Graph,
    half_b: Graph,
    then: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Run both halves, joined by a socket pair, to the end; then `then()`, still joined."""
    left, right = socket.socketpair(socket.AF_UNIX)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_attach, to_b, await _stream(left))
        tg.start_soon(_attach, to_a, await _stream(right))
        tg.start_soon(to_b.pump_overflow)
        tg.start_soon(to_a.pump_overflow)
        async with anyio.create_task_group() as graphs:
            graphs.start_soon(half_a.run)
            graphs.start_soon(half_b.run)
        if then is not None:
            await then()
        tg.cancel_scope.cancel()


async def run_halves(graph: ValidGraph, services: Any = None) -> tuple[Graph, Graph]:
    """Run process a's and process b's graphs, joined by a socket pair, to the end."""
    to_b, to_a, half_a, half_b = halves(graph, services)
    await join(to_b, to_a, half_a, half_b)
    return half_a, half_b


async def _stream(sock: socket.socket) -> socket.socket:
    sock.setblocking(False)
    return sock


async def _attach(p: Peer, sock: socket.socket) -> None:
    with pytest.raises(PeerGone):
        await p.attach(sock)


def test_messages_cross_in_order_and_the_end_propagates() -> None:
    graph = placed(PIPELINE % {"count": 3000, "delay": 0, "capacity": 16})
    assert graph.processes == ("a", "b")
    assert graph.channels["sink.in"].crosses and graph.channels["sink.in"].held == 32
    half_a, half_b = anyio.run(run_halves, graph)
    assert "sink" not in half_a.stages_here and "source" not in half_b.stages_here
    sink = half_b.stage("sink")
    assert isinstance(sink, Collect)
    assert [item.seq for item in sink.items] == list(range(3000))
    assert half_a.finished and half_b.finished  # the end of the stream reached b
    assert half_a.failure is None and half_b.failure is None


def test_a_slow_remote_consumer_makes_the_producer_wait_within_the_bound() -> None:
    capacity = 4
    graph = placed(PIPELINE % {"count": 60, "delay": 0.002, "capacity": capacity})
    in_flight: list[int] = []

    async def main() -> None:
        to_b, to_a, half_a, half_b = halves(graph)
        sink = half_b.stage("sink")
        assert isinstance(sink, Collect)
        channel = half_a.channels["sink.in"]
        # Sent so far minus handled so far: in transit, in b's channel, in the sink's hands.
        channel.add_tap(lambda message, _sent: in_flight.append(message.seq + 1 - len(sink.items)))
        await join(to_b, to_a, half_a, half_b)
        assert [item.seq for item in sink.items] == list(range(60))

    anyio.run(main)
    assert len(in_flight) == 60
    assert max(in_flight) <= 2 * capacity + 1  # credits in transit + b's channel + 1 handled
    assert max(in_flight) > capacity  # the producer ran ahead across the boundary


@pytest.mark.parametrize(
    ("count", "delay_s", "at_once"),
    [(3, 0.3, False), (4, 30.0, True)],
    ids=["fewer-than-half-wait-for-the-delay", "half-go-back-at-once"],
)
def test_owed_credits_go_back_together(
    count: int, delay_s: float, at_once: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver of a capacity-8 channel returns credits once 4 are owed, and fewer
    after `CREDIT_DELAY_S`: the sender gets all 8 back either way."""
    monkeypatch.setattr(remote, "CREDIT_DELAY_S", delay_s)
    capacity = 8
    graph = placed(PIPELINE % {"count": count, "delay": 0, "capacity": capacity})
    seen: list[int] = []

    async def main() -> None:
        to_b, to_a, half_a, half_b = halves(graph)

        async def credits_come_back() -> None:
            seen.append(to_b.credits("sink.in"))  # every message is in b by now
            with anyio.fail_after(0.25 if at_once else 5):
                while to_b.credits("sink.in") != capacity:
                    await anyio.sleep(0.005)

        await join(to_b, to_a, half_a, half_b, then=credits_come_back)
        assert len(half_b.stage("sink").items) == count  # type: ignore[attr-defined]

    anyio.run(main)
    if not at_once:
        assert seen == [capacity - count]  # owed, waiting for the delay


def test_the_wrong_type_is_refused_on_the_sending_side() -> None:
    graph = placed(PIPELINE % {"count": 1, "delay": 0, "capacity": 4})
    remote = Graph(
        graph,
        None,
        process="a",
        boundary=Boundary({"b": [peer(graph, "b")]}),
        logger=quiet_logger(),
    ).channels["sink.in"]
    with pytest.raises(ChannelTypeError, match="carries Item, got Other"):
        remote.sender().send_nowait(Other("x"))


def test_messages_to_an_absent_peer_are_handed_back_not_blocked_on() -> None:
    graph = placed(PIPELINE % {"count": 50, "delay": 0, "capacity": 2})
    lost: list[object] = []
    half_a = Graph(
        graph,
        None,
        process="a",
        boundary=Boundary({"b": [peer(graph, "b", lost)]}),
        logger=quiet_logger(),
    )
    anyio.run(half_a.run)
    assert [item.seq for item in lost] == list(range(50))  # type: ignore[attr-defined]


def test_stages_are_placed_all_or_none() -> None:
    with pytest.raises(GraphValidationError, match="names no process, but other stages do"):
        placed(
            """
            stages:
              - {name: source, process: a, use: "graph_toys:Count", with: {count: 1}}
              - {name: sink, use: "graph_toys:Collect"}
            edges:
              - source.out -> sink.in
            """
        )


def test_a_tensor_message_cannot_cross_processes() -> None:
    text = (Path(__file__).parents[2] / "flowllm/engine/default.yaml").read_text()
    text = text.replace("{name: sample,     process: core,", "{name: sample,     process: other,")
    with pytest.raises(GraphValidationError) as info:
        validate_graph(GraphSpec.from_yaml(text, source="<test>"))
    message = str(info.value)
    assert "edge execute.out -> sample.in crosses from process 'core' to 'other'" in message
    assert "StepLogits.logits" in message and "typed Any" in message


def test_a_per_step_channel_across_processes_is_sized_for_both_sides() -> None:
    text = (Path(__file__).parents[2] / "flowllm/engine/default.yaml").read_text()
    # detokenize.in holds 2 x 8 across processes: choices needs 16 + 1 + 1; 2 x 8 is short.
    text = text.replace(
        "{from: schedule.choices, to: detokenize.choices, capacity: 64}",
        "{from: schedule.choices, to: detokenize.choices, capacity: 8}",
    )
    with pytest.raises(GraphValidationError, match="holds 16 across processes, below the 18"):
        validate_graph(GraphSpec.from_yaml(text, source="<test>"))
