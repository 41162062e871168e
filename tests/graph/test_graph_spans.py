"""Spans and metrics: one event per handled message, Prometheus series per stage/channel."""

from __future__ import annotations

import io
import json
import logging
import random
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from flowllm.graph.metrics import DURATION_BUCKETS, GraphMetrics, LabelledHistogram
from flowllm.graph.runtime import Graph
from flowllm.graph.spans import SpanSinks, message_fields
from flowllm.graph.spec import GraphSpec
from flowllm.logging_config import configure_logging
from flowllm.messages import (
    Chunk,
    SampledTokens,
    ScheduledRows,
    StepBatch,
    StepTokens,
    TextDeltas,
    ValidRequest,
)

FIXTURES = Path(__file__).parent / "fixtures"

SLOW_PIPELINE = """
stages:
  - {name: source, use: "graph_toys:Count", with: {count: 30}}
  - {name: relay, use: "graph_toys:Relay"}
  - {name: sink, use: "graph_toys:Collect", with: {delay: 0.002}}
edges:
  - source.out -> relay.in
  - {from: relay.out, to: sink.in, capacity: 4}
"""


def capturing_logger(capture: structlog.testing.LogCapture, level: int = logging.DEBUG) -> Any:
    return structlog.wrap_logger(
        None, processors=[capture], wrapper_class=structlog.make_filtering_bound_logger(level)
    )


def run_graph(text: str, **kwargs: Any) -> Graph:
    graph = Graph(GraphSpec.from_yaml(text, base_dir=FIXTURES), **kwargs)

    async def main() -> None:
        with anyio.fail_after(20):
            await graph.run()

    anyio.run(main)
    return graph


def test_one_span_per_message_with_queue_wait_when_the_consumer_is_slow() -> None:
    capture = structlog.testing.LogCapture()
    graph = run_graph(SLOW_PIPELINE, logger=capturing_logger(capture))
    spans = [e for e in capture.entries if e["event"] == "span"]
    by_stage: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_stage.setdefault(span["stage"], []).append(span)
    assert sorted(by_stage) == ["relay", "sink"]  # `source` has a hand-written run, no spans
    assert len(by_stage["relay"]) == 30 and len(by_stage["sink"]) == 30
    sink_waits = [s["queue_wait_s"] for s in by_stage["sink"]]
    assert all(w >= 0 for w in sink_waits)
    # The sink takes 2 ms per message and its channel holds 4: later messages wait ~8 ms.
    assert max(sink_waits) > 0.004
    assert min(s["duration_s"] for s in by_stage["sink"]) >= 0.0015
    assert {s["graph"] for s in spans} == {"graph"} and {s["replica"] for s in spans} == {0}

    registry = graph.registry
    assert registry.get_sample_value(
        "flowllm:stage_duration_seconds_count", {"stage": "sink"}
    ) == pytest.approx(30)
    assert registry.get_sample_value(
        "flowllm:stage_duration_seconds_sum", {"stage": "sink"}
    ) == pytest.approx(sum(s["duration_s"] for s in by_stage["sink"]))
    assert registry.get_sample_value(
        "flowllm:stage_queue_wait_seconds_sum", {"stage": "sink"}
    ) == pytest.approx(sum(sink_waits))
    # Depth gauges are sampled at scrape time; the graph has drained, so they read 0.
    for channel in ("relay.in", "sink.in"):
        assert registry.get_sample_value("flowllm:channel_depth", {"channel": channel}) == 0
    assert registry.get_sample_value("flowllm:graph_healthy") == 0  # finished
    text = generate_latest(registry).decode()
    assert "# TYPE flowllm:stage_duration_seconds histogram" in text
    assert "# TYPE flowllm:stage_errors_total counter" in text


def test_depth_gauge_reads_the_live_channel() -> None:
    graph = Graph(
        GraphSpec.from_yaml(
            """
            stages:
              - {name: feeder, use: "graph_toys:Feeder"}
              - {name: sink, use: "graph_toys:Collect", with: {delay: 5}}
            edges:
              - {from: feeder.out, to: sink.in, capacity: 8}
            """,
            base_dir=FIXTURES,
        ),
        logger=capturing_logger(structlog.testing.LogCapture(), logging.WARNING),
    )
    depth: list[float | None] = []

    async def main() -> None:
        from graph_toys import Item

        with anyio.fail_after(10):
            async with graph.serve(stop_timeout=0.1):
                for seq in range(6):
                    await graph.stage("feeder").submit(Item(seq))  # type: ignore[attr-defined]
                await anyio.sleep(0.01)
                depth.append(
                    graph.registry.get_sample_value("flowllm:channel_depth", {"channel": "sink.in"})
                )
                depth.append(graph.registry.get_sample_value("flowllm:graph_healthy"))

    anyio.run(main)
    assert depth == [5, 1]  # one message is in the sink's hands, five wait


def test_span_events_are_skipped_below_debug_but_metrics_are_kept() -> None:
    capture = structlog.testing.LogCapture()
    graph = run_graph(SLOW_PIPELINE, logger=capturing_logger(capture, logging.INFO))
    assert not [e for e in capture.entries if e["event"] == "span"]
    assert graph.registry.get_sample_value(
        "flowllm:stage_duration_seconds_count", {"stage": "relay"}
    ) == pytest.approx(30)
    off = run_graph(SLOW_PIPELINE, logger=capturing_logger(capture), spans=False)
    assert off.registry.get_sample_value(
        "flowllm:stage_duration_seconds_count", {"stage": "relay"}
    ) == pytest.approx(0)


def test_step_messages_carry_step_id_and_batch_size() -> None:
    capture = structlog.testing.LogCapture()
    run_graph((FIXTURES / "cycle_ok.yaml").read_text(), logger=capturing_logger(capture))
    spans = [e for e in capture.entries if e["event"] == "span" and e["stage"] == "execute"]
    assert len(spans) == 100  # 20 requests x 5 steps
    assert all(s["batch_size"] == 1 for s in spans)
    assert sorted(s["step_id"] for s in spans) == list(range(100))


def test_message_fields_for_the_project_messages() -> None:
    from flowllm.messages import GenerateRequest, SamplingParams

    request = GenerateRequest(
        request_id="r1", model="m", params=SamplingParams(), arrival_time=0.0, prompt="hi"
    )
    assert message_fields(request) == {"request_id": "r1"}
    assert message_fields(ValidRequest(request)) == {"request_id": "r1"}
    batch = StepBatch(step_id=7, rows=ScheduledRows.of(()))
    assert message_fields(batch) == {"step_id": 7, "batch_size": 0}
    two_rows = ScheduledRows(
        seq_ids=(1, 2),
        query_lens=(1, 1),
        token_ids=(5, 6),
        num_computed_tokens=(3, 4),
        block_tables=((0,), (1,)),
        sample=(True, True),
        num_output_tokens=(0, 0),
    )
    assert message_fields(StepBatch(step_id=8, rows=two_rows)) == {"step_id": 8, "batch_size": 2}
    three = SampledTokens(seq_ids=(1, 2, 3), token_ids=(7, 8, 9))
    assert message_fields(StepTokens(step_id=8, sampled=three)) == {"step_id": 8, "batch_size": 3}
    deltas = TextDeltas(
        step_id=3, chunks=(Chunk(request_id="a", index=0, text="x", token_ids=(1,)),)
    )
    assert message_fields(deltas) == {"step_id": 3, "batch_size": 1}
    assert message_fields(42) == {}


def test_labelled_histogram_matches_prometheus_client_histogram() -> None:
    ours_registry, theirs_registry = CollectorRegistry(), CollectorRegistry()
    ours = LabelledHistogram("x_seconds", "doc", "stage", DURATION_BUCKETS, ours_registry)
    theirs = Histogram(
        "x_seconds", "doc", ["stage"], buckets=DURATION_BUCKETS, registry=theirs_registry
    )
    rng = random.Random(0)
    values = [
        rng.choice([1e-5, 0.5, 10.0]) if i % 7 == 0 else rng.expovariate(100.0) for i in range(500)
    ]
    for i, value in enumerate(values):
        label = "a" if i % 3 else "b"
        ours.labels(label).observe(value)
        theirs.labels(label).observe(value)

    def samples(
        registry: CollectorRegistry,
    ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in registry.collect()
            for s in metric.samples
            if not s.name.endswith("_created")
        }

    mine, reference = samples(ours_registry), samples(theirs_registry)
    assert mine.keys() == reference.keys()
    for key, value in reference.items():
        assert mine[key] == pytest.approx(value), key


def test_each_graph_owns_its_registry() -> None:
    first, second = GraphMetrics(), GraphMetrics()
    first.stage_errors.labels("s").inc()
    assert second.registry.get_sample_value("flowllm:stage_errors_total", {"stage": "s"}) is None


def test_configure_logging_json_and_console() -> None:
    try:
        out = io.StringIO()
        configure_logging(fmt="json", level="debug", stream=out, force=True)
        structlog.get_logger("t").bind(stage="x").debug("span", duration_s=0.5)
        record = json.loads(out.getvalue().splitlines()[-1])
        assert record["event"] == "span" and record["stage"] == "x" and record["level"] == "debug"
        configure_logging(fmt="json", stream=io.StringIO())  # already configured: no change
        structlog.get_logger("t").info("again")
        assert json.loads(out.getvalue().splitlines()[-1])["event"] == "again"
        out = io.StringIO()
        configure_logging(fmt="auto", level="info", stream=out, force=True)  # not a TTY: JSON
        structlog.get_logger("t").debug("hidden")
        structlog.get_logger("t").warning("shown")
        assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["shown"]
        out = io.StringIO()
        configure_logging(fmt="console", stream=out, force=True)
        structlog.get_logger("t").info("hello", stage="y")
        assert "hello" in out.getvalue() and "stage" in out.getvalue()
        with pytest.raises(ValueError, match="log format"):
            configure_logging(fmt="xml", force=True)
    finally:
        structlog.reset_defaults()


def test_span_sinks_tell_their_owner_as_the_first_comes_and_the_last_goes() -> None:
    told: list[bool] = []
    sinks = SpanSinks(told.append)
    seen: list[tuple[str, str, object]] = []

    def first(stage: str, message: object, started: float, duration: float, wait: float) -> None:
        seen.append(("first", stage, message))

    def second(stage: str, message: object, started: float, duration: float, wait: float) -> None:
        seen.append(("second", stage, message))

    assert not sinks
    sinks.add(first)
    sinks.add(second)
    assert told == [True] and list(sinks) == [first, second]
    sinks.relay("execute", "m", 0.0, 0.1, 0.0)  # a span from the graph's other process
    assert seen == [("first", "execute", "m"), ("second", "execute", "m")]
    sinks.remove(first)
    assert told == [True] and first not in sinks and len(sinks) == 1
    sinks.remove(second)
    assert told == [True, False] and not sinks
