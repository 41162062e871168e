"""Request traces in process, read from the OpenTelemetry SDK's in-memory exporter: the
root span per HTTP request, a child per per-request stage, per-step spans linked to the
requests of their step, the caller's traceparent honoured, and nothing left open."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from litestar.testing import AsyncTestClient
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from flowllm.api.app import create_app
from flowllm.config import engine_config
from flowllm.engine.async_engine import AsyncEngine
from flowllm.engine.loading import build_services
from flowllm.stages.services import EngineServices
from flowllm.tracing import RequestTracing, TracingError, traces_url

CALLER_TRACE = 0x0AF7651916CD43DD8448EB211C80319C
CALLER_SPAN = 0xB7AD6B7169203331
TRACEPARENT = f"00-{CALLER_TRACE:032x}-{CALLER_SPAN:016x}-01"
PER_REQUEST = {"validate", "tokenize", "schedule"}
PER_STEP = {  # guide: none, since no request is constrained
    "step schedule",
    "step execute",
    "step sample",
    "step detokenize",
    "step deliver",
}


@pytest.fixture(scope="module")
def services(gpt2_tiny_dir: Path) -> EngineServices:
    return build_services(
        engine_config(
            str(gpt2_tiny_dir), dtype="float32", kv_cache_memory=1 << 22, served_model_name="tiny"
        )
    )


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    yield exporter
    exporter.shutdown()


@pytest.fixture
async def traced(
    services: EngineServices, exporter: InMemorySpanExporter
) -> AsyncIterator[tuple[AsyncTestClient, RequestTracing]]:
    tracing = RequestTracing(SimpleSpanProcessor(exporter))

    @asynccontextmanager
    async def engine() -> AsyncIterator[AsyncEngine]:
        async with AsyncEngine.start(
            services=services.fresh(), span_sinks=(tracing.span_sink,)
        ) as running:
            yield running

    app = create_app(engine, served_model_name="tiny", tracing=tracing)
    async with AsyncTestClient(app) as client:
        yield client, tracing
    tracing.shutdown()


def roots(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name and s.kind == SpanKind.SERVER]


@pytest.mark.anyio
async def test_spans_and_their_parentage(
    traced: tuple[AsyncTestClient, RequestTracing], exporter: InMemorySpanExporter
) -> None:
    client, tracing = traced
    response = await client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": ["one two", "three four five"], "max_tokens": 3,
              "temperature": 0.0, "ignore_eos": True},
        headers={"traceparent": TRACEPARENT},
    )  # fmt: skip
    assert response.status_code == 200
    usage = response.json()["usage"]
    spans = exporter.get_finished_spans()
    (root,) = roots(spans, "POST /v1/completions")
    assert root.context.trace_id == CALLER_TRACE
    assert root.parent is not None and root.parent.span_id == CALLER_SPAN
    assert root.parent.is_remote
    attrs = root.attributes
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 3
    assert attrs["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 6
    assert list(attrs["gen_ai.response.finish_reasons"]) == ["length", "length"]
    queue = attrs["gen_ai.latency.time_in_queue"]
    prefill = attrs["gen_ai.latency.time_in_model_prefill"]
    ttft = attrs["gen_ai.latency.time_to_first_token"]
    assert queue >= 0 and prefill >= 0 and queue + prefill == pytest.approx(ttft, abs=1e-3)
    assert ttft <= attrs["gen_ai.latency.e2e"]
    # One child per per-request stage per prompt, inside the root, with its queue wait.
    root_id = root.context.span_id
    children = [s for s in spans if s.parent is not None and s.parent.span_id == root_id]
    assert sorted(s.name for s in children) == sorted([*PER_REQUEST] * 2)
    for child in children:
        assert child.context.trace_id == CALLER_TRACE
        assert child.attributes["flowllm.queue_wait_s"] >= 0
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time
    # Per-step spans: traces of their own, each linked to this request's root.
    steps = [s for s in spans if s.name.startswith("step ")]
    assert {s.name for s in steps} == PER_STEP
    for step in steps:
        assert step.parent is None and step.context.trace_id != CALLER_TRACE
        assert [link.context.span_id for link in step.links] == [root.context.span_id]
    assert tracing.open_requests == 0


@pytest.mark.anyio
async def test_refused_requests_are_traced_too(
    traced: tuple[AsyncTestClient, RequestTracing], exporter: InMemorySpanExporter
) -> None:
    client, tracing = traced
    response = await client.post(
        "/v1/completions", content=b"x", headers={"traceparent": TRACEPARENT}
    )
    assert response.status_code == 415
    bad = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 0})
    assert bad.status_code == 400
    spans = roots(exporter.get_finished_spans(), "POST /v1/completions")
    assert [s.attributes["http.response.status_code"] for s in spans] == [415, 400]
    assert spans[0].context.trace_id == CALLER_TRACE
    assert all(s.status.status_code != StatusCode.ERROR for s in spans)
    assert tracing.open_requests == 0


def test_endpoint_urls() -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"
    for bad in ("grpc://collector:4317", "collector:4318", "http://"):
        with pytest.raises(TracingError):
            traces_url(bad)


def test_a_bad_endpoint_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "flowllm", "serve", str(tmp_path / "no-model"),
         "--otlp-traces-endpoint", "grpc://localhost:4317"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "--otlp-traces-endpoint must be an OTLP/HTTP URL" in result.stderr
    assert "no-model" not in result.stderr  # it stopped before looking for the model


def test_without_the_flag_opentelemetry_is_not_imported() -> None:
    code = (
        "import sys\n"
        "from flowllm.cli import build_parser\n"
        "from flowllm.cli.serve import request_tracing\n"
        "import flowllm.api.app, flowllm.engine.async_engine, flowllm.server\n"
        "assert request_tracing(build_parser().parse_args(['serve'])) is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
