"""The graph runtime with toy stages: delivery, backpressure, fan-in, replicas, failure, stop."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from graph_toys import Collect, Feeder, Item, Loop, Pending, Relay
from hypothesis import given, settings
from hypothesis import strategies as st

from flowllm.graph.channel import ChannelTypeError
from flowllm.graph.runtime import Graph, GraphStoppedError
from flowllm.graph.spec import GraphSpec
from flowllm.graph.stage import StageNotRunningError

FIXTURES = Path(__file__).parent / "fixtures"


def make_graph(text: str, services: Any = None, **kwargs: Any) -> Graph:
    spec = GraphSpec.from_yaml(text, source="<test>", base_dir=FIXTURES)
    kwargs.setdefault("logger", quiet_logger())
    return Graph(spec, services, **kwargs)


def quiet_logger(capture: structlog.testing.LogCapture | None = None) -> Any:
    """A logger writing nowhere (or into `capture`), enabled for DEBUG."""
    processors: list[Any] = [capture] if capture is not None else [_drop]
    return structlog.wrap_logger(
        None,
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    )


def _drop(logger: Any, method: str, event: Any) -> Any:
    raise structlog.DropEvent


def run(graph: Graph, limit: float = 20.0) -> None:
    async def main() -> None:
        with anyio.fail_after(limit):
            await graph.run()

    anyio.run(main)


def test_three_stage_pipeline_delivers_10000_in_order() -> None:
    graph = make_graph(
        """
        stages:
          - {name: source, use: "graph_toys:Count", with: {count: 10000}}
          - {name: relay, use: "graph_toys:Relay"}
          - {name: sink, use: "graph_toys:Collect"}
        edges:
          - source.out -> relay.in
          - {from: relay.out, to: sink.in, capacity: 16}
        """
    )
    run(graph)
    sink = graph.stage("sink")
    assert isinstance(sink, Collect)
    assert [item.seq for item in sink.items] == list(range(10000))
    assert graph.failure is None
    assert graph.finished and not graph.healthy  # finished graphs do not serve


def test_slow_consumer_makes_producer_wait_and_channels_stay_bounded() -> None:
    capacity = 4
    graph = make_graph(
        f"""
        stages:
          - {{name: source, use: "graph_toys:Count", with: {{count: 60}}}}
          - {{name: sink, use: "graph_toys:Collect", with: {{delay: 0.001}}}}
        edges:
          - {{from: source.out, to: sink.in, capacity: {capacity}}}
        """
    )
    channel = graph.channels["sink.in"]
    sink = graph.stage("sink")
    assert isinstance(sink, Collect)
    depths: list[int] = []
    ahead: list[int] = []

    def tap(message: Any, send_time: float) -> None:
        depths.append(channel.depth())
        # Sent so far minus handled so far: the buffer plus the message in the sink's hands.
        ahead.append(message.seq + 1 - len(sink.items))

    channel.add_tap(tap)
    run(graph)
    assert len(depths) == 60
    assert max(depths) <= capacity
    assert max(depths) == capacity  # the producer ran ahead until the channel was full ...
    assert max(ahead) <= capacity + 1  # ... and then waited for the consumer
    assert [item.seq for item in sink.items] == list(range(60))


def test_fan_in_delivers_every_message_exactly_once() -> None:
    graph = make_graph(
        """
        stages:
          - {name: a, use: "graph_toys:Count", with: {count: 1500}}
          - {name: b, use: "graph_toys:Count", with: {count: 1500}}
          - {name: c, use: "graph_toys:Count", with: {count: 1500}}
          - {name: sink, use: "graph_toys:Collect"}
        edges:
          - a.out -> sink.in
          - {from: b.out, to: sink.in, capacity: 8}
          - c.out -> sink.in
        """
    )
    assert graph.channels["sink.in"].capacity == 64  # the largest capacity of the fan-in
    run(graph)
    sink = graph.stage("sink")
    assert isinstance(sink, Collect)
    assert len(sink.items) == 4500
    for origin in "abc":
        # Each producer's messages arrive once each, in that producer's order.
        assert [i.seq for i in sink.items if i.origin == origin] == list(range(1500))
    origins = [i.origin for i in sink.items[:300]]
    assert len(set(origins)) == 3  # producers interleave; none is starved


def test_replicas_share_one_inbox_and_deliver_exactly_once() -> None:
    graph = make_graph(
        """
        stages:
          - {name: source, use: "graph_toys:Count", with: {count: 400}}
          - {name: relay, use: "graph_toys:Relay", with: {delay: 0.0005}, replicas: 4}
          - {name: sink, use: "graph_toys:Collect"}
        edges:
          - source.out -> relay.in
          - relay.out -> sink.in
        """
    )
    relays = graph.replicas("relay")
    assert len(relays) == 4 and len({id(r) for r in relays}) == 4
    run(graph)
    sink = graph.stage("sink")
    assert isinstance(sink, Collect)
    assert sorted(item.seq for item in sink.items) == list(range(400))
    handled = [r.handled for r in relays if isinstance(r, Relay)]
    assert sum(handled) == 400
    assert all(count > 0 for count in handled)  # the work was spread over the replicas


def test_a_failing_stage_fails_inflight_work_and_the_runtime_returns() -> None:
    capture = structlog.testing.LogCapture()
    services: dict[str, Any] = {}
    graph = make_graph(
        """
        stages:
          - {name: source, use: "graph_toys:Count", with: {count: 100000}}
          - {name: explode, use: "graph_toys:Explode", with: {fail_at: 500},
             supervision: {on_error: escalate}}
          - {name: pending, use: "graph_toys:Pending"}
          - {name: slow, use: "graph_toys:Collect", with: {delay: 10}}
          - {name: side, use: "graph_toys:Count", with: {count: 100}}
        edges:
          - source.out -> explode.in
          - {from: explode.out, to: pending.in, capacity: 4}
          - {from: side.out, to: slow.in, capacity: 2}
        """,
        services,
        logger=quiet_logger(capture),
    )
    run(graph, limit=10.0)  # also: the blocked `side` producer and sleeping `slow` end
    pending = services["pending"]
    assert isinstance(pending, Pending)
    assert graph.failure is not None and graph.failure.stage == "explode"
    assert "boom at 500" in graph.failure.traceback
    assert not graph.healthy
    # Every item `pending` held failed (a few may still have sat in its channel) ...
    assert sorted(pending.failed) == list(range(len(pending.failed)))
    assert len(pending.failed) >= 500 - 4 - 1
    assert all("boom at 500" in reason for reason in pending.failed.values())
    assert not pending.open  # ... and none is left open
    slow = graph.stage("slow")
    assert isinstance(slow, Collect) and isinstance(slow.failed_with, RuntimeError)
    errors = [e for e in capture.entries if e["log_level"] == "error" and "stage" in e]
    assert errors[0]["stage"] == "explode" and errors[0]["exc_info"] is graph.failure.error
    assert graph.registry.get_sample_value(
        "flowllm:stage_errors_total", {"stage": "explode"}
    ) == pytest.approx(1.0)


def test_graceful_stop_drains_queued_messages() -> None:
    graph = make_graph(
        """
        stages:
          - {name: feeder, use: "graph_toys:Feeder"}
          - {name: relay, use: "graph_toys:Relay"}
          - {name: sink, use: "graph_toys:Collect", with: {delay: 0.002}}
        edges:
          - {from: feeder.out, to: relay.in, capacity: 16}
          - {from: relay.out, to: sink.in, capacity: 16}
        """
    )
    queued_at_stop: list[int] = []

    async def main() -> None:
        with anyio.fail_after(10):
            async with graph.serve(stop_timeout=5) as running:
                assert running.healthy
                feeder = running.stage("feeder")
                assert isinstance(feeder, Feeder)
                for seq in range(40):
                    await feeder.submit(Item(seq))
                queued_at_stop.append(sum(c.depth() for c in running.channels.values()))
            assert graph.finished
            with pytest.raises(RuntimeError, match="not accepting"):
                await feeder.submit(Item(99))

    anyio.run(main)
    sink = graph.stage("sink")
    assert isinstance(sink, Collect)
    assert queued_at_stop[0] > 10  # messages were still queued when the stop began
    assert [item.seq for item in sink.items] == list(range(40))
    assert graph.failure is None


def test_stop_cancels_after_the_timeout_when_the_graph_cannot_drain() -> None:
    graph = make_graph(
        """
        stages:
          - {name: feeder, use: "graph_toys:Feeder"}
          - {name: sink, use: "graph_toys:Collect", with: {delay: 30}}
        edges:
          - feeder.out -> sink.in
        """
    )
    drained: list[bool] = []

    async def main() -> None:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                await tg.start(graph.run)
                feeder = graph.stage("feeder")
                assert isinstance(feeder, Feeder)
                await feeder.submit(Item(0))
                await feeder.submit(Item(1))
                drained.append(await graph.stop(timeout=0.2))

    anyio.run(main)
    assert drained == [False]
    assert graph.finished and graph.failure is None
    sink = graph.stage("sink")
    assert isinstance(sink, Collect)
    assert isinstance(sink.failed_with, GraphStoppedError)  # the open work was answered
    assert "drain timeout 0.2 s" in str(sink.failed_with)


def test_cycle_through_a_credit_bounded_stage_runs_to_completion() -> None:
    graph = Graph(FIXTURES / "cycle_ok.yaml", logger=quiet_logger())
    run(graph)
    loop = graph.stage("loop")
    sink = graph.stage("sink")
    assert isinstance(loop, Loop) and isinstance(sink, Collect)
    assert sorted(item.seq for item in sink.items) == list(range(20))
    assert loop.max_inflight_seen == 2


def test_user_stage_from_a_py_file_runs() -> None:
    graph = Graph(FIXTURES / "py_file_stage.yaml", logger=quiet_logger())
    run(graph)
    assert graph.stage("gather").values == [0, 3, 6, 9, 12]  # type: ignore[attr-defined]


def test_emitting_outside_a_running_graph_or_the_wrong_type_fails() -> None:
    graph = make_graph(
        """
        stages:
          - {name: feeder, use: "graph_toys:Feeder"}
          - {name: sink, use: "graph_toys:Collect"}
        edges:
          - feeder.out -> sink.in
        """
    )
    feeder = graph.stage("feeder")
    assert isinstance(feeder, Feeder)
    with pytest.raises(StageNotRunningError):
        _ = feeder.context
    with pytest.raises(KeyError, match="no stage 'fedeer'"):
        graph.stage("fedeer")
    errors: list[BaseException] = []

    async def main() -> None:
        with anyio.fail_after(5):
            async with graph.serve(stop_timeout=2):
                try:
                    await feeder.context.emit("out", "not an item")
                except ChannelTypeError as exc:
                    errors.append(exc)
        with pytest.raises(RuntimeError, match="already run"):
            await graph.run()

    anyio.run(main)
    assert "carries Item, got str" in str(errors[0])


def test_a_stage_that_ends_early_does_not_break_or_block_its_producers() -> None:
    graph = make_graph(
        """
        stages:
          - {name: source, use: "graph_toys:Count", with: {count: 500}}
          - {name: take, use: "graph_toys:Take", with: {count: 5}}
          - {name: sink, use: "graph_toys:Collect"}
        edges:
          - {from: source.out, to: take.in, capacity: 2}
          - take.out -> sink.in
        """
    )
    run(graph, limit=10.0)
    sink = graph.stage("sink")
    assert isinstance(sink, Collect)
    assert graph.failure is None
    assert [item.seq for item in sink.items] == list(range(5))


def test_serve_reraises_the_owners_error_after_stopping_the_graph() -> None:
    graph = make_graph(
        """
        stages:
          - {name: feeder, use: "graph_toys:Feeder"}
          - {name: sink, use: "graph_toys:Collect"}
        edges:
          - feeder.out -> sink.in
        """
    )

    async def main() -> None:
        assert await graph.stop() is True  # not started: nothing to stop
        with anyio.fail_after(5), pytest.raises(ValueError, match="owner failed"):
            async with graph.serve(stop_timeout=2):
                await graph.stage("feeder").submit(Item(1))  # type: ignore[attr-defined]
                raise ValueError("owner failed")

    anyio.run(main)
    assert graph.finished and graph.failure is None
    sink = graph.stage("sink")
    assert isinstance(sink, Collect) and sink.items == [Item(1)]


@settings(max_examples=25, deadline=None)
@given(
    count=st.integers(0, 60),
    hops=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 3)), min_size=0, max_size=3),
    sink_capacity=st.integers(1, 5),
)
def test_any_chain_delivers_everything_once_and_keeps_order_without_replicas(
    count: int, hops: list[tuple[int, int]], sink_capacity: int
) -> None:
    stages = [f'  - {{name: source, use: "graph_toys:Count", with: {{count: {count}}}}}']
    edges = []
    previous = "source"
    for index, (capacity, replicas) in enumerate(hops):
        name = f"relay{index}"
        stages.append(f'  - {{name: {name}, use: "graph_toys:Relay", replicas: {replicas}}}')
        edges.append(f"  - {{from: {previous}.out, to: {name}.in, capacity: {capacity}}}")
        previous = name
    stages.append('  - {name: sink, use: "graph_toys:Collect"}')
    edges.append(f"  - {{from: {previous}.out, to: sink.in, capacity: {sink_capacity}}}")
    graph = make_graph("\n".join(["stages:", *stages, "edges:", *edges]))
    depths: list[tuple[int, int]] = []
    for channel in graph.channels.values():
        channel.add_tap(lambda m, t, c=channel: depths.append((c.depth(), c.capacity)))
    run(graph, limit=10.0)
    sink = graph.stage("sink")
    assert isinstance(sink, Collect)
    seqs = [item.seq for item in sink.items]
    assert sorted(seqs) == list(range(count))
    if all(replicas == 1 for _, replicas in hops):
        assert seqs == list(range(count))
    assert all(depth <= capacity for depth, capacity in depths)


def test_span_sinks_can_come_and_go_while_the_graph_runs() -> None:
    """A sink added while the graph runs sees the spans from then on; removed, no more."""
    graph = make_graph(
        """
        stages:
          - {name: feeder, use: "graph_toys:Feeder"}
          - {name: relay, use: "graph_toys:Relay"}
          - {name: sink, use: "graph_toys:Collect"}
        edges:
          - feeder.out -> relay.in
          - relay.out -> sink.in
        """
    )
    seen: list[tuple[str, int]] = []

    def sink(stage: str, message: Any, started: float, duration: float, wait: float) -> None:
        if isinstance(message, Item):
            seen.append((stage, message.seq))

    async def main() -> None:
        async with graph.serve(stop_timeout=5):
            feeder = graph.stage("feeder")
            assert isinstance(feeder, Feeder)

            async def send(seq: int) -> None:
                await feeder.submit(Item(seq))
                with anyio.fail_after(5):
                    while len(graph.stage("sink").items) <= seq:  # type: ignore[attr-defined]
                        await anyio.sleep(0.001)

            await send(0)
            graph.span_sinks.add(sink)
            await send(1)
            graph.span_sinks.remove(sink)
            await send(2)

    anyio.run(main)
    assert sorted(seen) == [("relay", 1), ("sink", 1)]
