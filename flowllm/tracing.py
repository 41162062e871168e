"""OpenTelemetry traces of requests (`flowllm serve --otlp-traces-endpoint URL`).

Every HTTP request is a trace: `TracingMiddleware` opens a root SERVER span (a child of
the caller's span when the request carries a W3C `traceparent`), the route `bind`s the
graph requests it submits to that span, and `RequestTracing.span_sink`, a graph span sink,
turns every stage's span of one of those requests into a child span, with its queue wait
as an attribute. A per-step message serves many requests: its span starts a trace of its
own, linked to the root span of every request in the step (span links). When the root span
ends it carries the OpenTelemetry GenAI attributes (model, token counts, finish reasons)
and vLLM's latency attributes (time to first token, queue, prefill, decode).

The SDK's `BatchSpanProcessor` encodes and exports from its own thread; the event loop
only creates spans. Nothing here is imported, and no sink or middleware is installed,
unless tracing was asked for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import urlsplit

from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, HTTPScope, Message, Receive, Scope, Send
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from flowllm.graph.spans import InputClosed
from flowllm.messages import (
    Abort,
    Finish,
    GenerateRequest,
    RequestError,
    StepBatch,
    StepLogits,
    TextDeltas,
    TokenizedRequest,
    ValidRequest,
    seq_ids_of,
)
from flowllm.version import __version__

SCOPE_SPAN = "flowllm.otel_span"  # the request's root span, in the ASGI scope
SCOPE_REQUESTS = "flowllm.otel_requests"  # the graph request ids bound to it
_PROPAGATOR = TraceContextTextMapPropagator()
STEP_LINKS_KEPT = 8  # steps whose links are kept for the stages after execute


class TracingError(ValueError):
    """An --otlp-traces-endpoint that cannot be exported to."""


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of `endpoint`: as given, or with `/v1/traces` added when it
    names no path (as OTEL_EXPORTER_OTLP_ENDPOINT does). gRPC is not supported."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise TracingError(
            f"--otlp-traces-endpoint must be an OTLP/HTTP URL such as "
            f"http://localhost:4318/v1/traces (gRPC is not supported), got {endpoint!r}"
        )
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


class _RequestTrace:
    """What one graph request's trace knows: its root span and what its chunks said."""

    __slots__ = (
        "arrival_time",
        "finish_reasons",
        "first_chunk_time",
        "input_tokens",
        "last_chunk_time",
        "output_tokens",
        "root",
        "scheduled_time",
        "seq_ids",
    )

    def __init__(self, root: trace.Span, arrival_time: float) -> None:
        self.root = root
        self.arrival_time = arrival_time
        self.seq_ids: list[int] = []
        self.scheduled_time = 0.0
        self.first_chunk_time = 0.0
        self.last_chunk_time = 0.0
        self.input_tokens = 0
        self.output_tokens: dict[int, int] = {}  # choice index -> tokens
        self.finish_reasons: dict[int, str] = {}


class RequestTracing:
    """The traces of one server: spans go to `processor` (an OTLP exporter behind a batch
    processor in production, an in-memory exporter in tests)."""

    def __init__(self, processor: SpanProcessor, *, max_links: int = 256) -> None:
        resource: dict[str, str] = {"service.version": __version__}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            resource["service.name"] = "flowllm"
        self.provider = TracerProvider(
            resource=Resource.create(resource),
            span_limits=SpanLimits(max_links=max(128, max_links)),
        )
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("flowllm", __version__)
        self._requests: dict[str, _RequestTrace] = {}
        self._seqs: dict[int, _RequestTrace] = {}
        self._step_links: dict[int, list[Link]] = {}
        # perf_counter() (the graph's span clock) and time.monotonic() (the requests'
        # clock) to Unix nanoseconds, which OpenTelemetry wants.
        now_ns = time.time_ns()
        self._perf_offset = now_ns - int(time.perf_counter() * 1e9)
        self._mono_offset = now_ns - int(time.monotonic() * 1e9)

    @classmethod
    def to_endpoint(cls, endpoint: str, *, max_links: int = 256) -> RequestTracing:
        """Export over OTLP/HTTP (protobuf) to `endpoint`, batched in the SDK's thread."""
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=traces_url(endpoint))
        return cls(BatchSpanProcessor(exporter), max_links=max_links)

    @property
    def open_requests(self) -> int:
        """Graph requests bound to a root span that has not ended yet."""
        return len(self._requests)

    def shutdown(self) -> None:
        """Export what is buffered and stop the exporter thread."""
        self.provider.shutdown()

    # -- the HTTP side --------------------------------------------------------------------

    def start_request(self, scope: Scope) -> trace.Span:
        """The root span of an HTTP request: a child of its `traceparent`, if any."""
        carrier = {
            name.decode("latin-1"): value.decode("latin-1")
            for name, value in scope["headers"]
            if name in (b"traceparent", b"tracestate")
        }
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        method = cast("HTTPScope", scope)["method"]  # the middleware's `scopes`: HTTP only
        path = scope["path"]
        return self.tracer.start_span(
            f"{method} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={"http.request.method": method, "url.path": path},
        )

    def bind(
        self,
        scope: Scope,
        requests: Sequence[GenerateRequest],
        *,
        operation: str,
        response_id: str,
    ) -> None:
        """Make the graph requests of an API request part of its trace (call before
        submitting them)."""
        root: trace.Span | None = scope.get(SCOPE_SPAN)  # type: ignore[assignment]
        if root is None or not requests:
            return
        first = requests[0]
        params = first.params
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.system": "flowllm",
            "gen_ai.request.model": first.model,
            "gen_ai.response.id": response_id,
            "gen_ai.request.temperature": params.temperature,
            "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n,
        }
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if params.seed is not None:
            attributes["gen_ai.request.seed"] = params.seed
        root.set_attributes(attributes)
        # litestar's Scope types name no extension keys, which ASGI scopes may carry.
        bound: list[str] = scope.setdefault(SCOPE_REQUESTS, [])  # type: ignore[misc]
        for request in requests:
            self._requests[request.request_id] = _RequestTrace(root, request.arrival_time)
            bound.append(request.request_id)

    def end_request(self, root: trace.Span, request_ids: Sequence[str], status: int) -> None:
        """Close the root span with what its graph requests reported."""
        traces = [t for t in (self._requests.pop(rid, None) for rid in request_ids) if t]
        for request_trace in traces:
            for seq_id in request_trace.seq_ids:
                self._seqs.pop(seq_id, None)
        if traces:
            root.set_attributes(self._usage(traces))
        if status:
            root.set_attribute("http.response.status_code", status)
            if status >= 500:
                root.set_status(Status(StatusCode.ERROR))
        root.end()

    @staticmethod
    def _usage(traces: list[_RequestTrace]) -> dict[str, Any]:
        attributes: dict[str, Any] = {
            "gen_ai.usage.input_tokens": sum(t.input_tokens for t in traces),
            "gen_ai.usage.output_tokens": sum(sum(t.output_tokens.values()) for t in traces),
        }
        reasons = [r for t in traces for _, r in sorted(t.finish_reasons.items())]
        if reasons:
            attributes["gen_ai.response.finish_reasons"] = reasons
        first = traces[0]
        if first.first_chunk_time:
            attributes["gen_ai.latency.time_to_first_token"] = (
                first.first_chunk_time - first.arrival_time
            )
        if first.last_chunk_time:
            attributes["gen_ai.latency.e2e"] = first.last_chunk_time - first.arrival_time
        if first.scheduled_time:
            attributes["gen_ai.latency.time_in_queue"] = first.scheduled_time - first.arrival_time
            if first.first_chunk_time:
                attributes["gen_ai.latency.time_in_model_prefill"] = (
                    first.first_chunk_time - first.scheduled_time
                )
            if first.last_chunk_time:
                attributes["gen_ai.latency.time_in_model_decode"] = (
                    first.last_chunk_time - first.first_chunk_time
                )
        return attributes

    # -- the graph side -------------------------------------------------------------------

    def span_sink(
        self, stage: str, message: Any, started: float, duration: float, queue_wait: float
    ) -> None:
        """A graph span sink (flowllm.graph.spans.SpanSink): one OpenTelemetry span per
        stage span of a traced request or of a step that holds one."""
        if isinstance(message, InputClosed) or not self._requests:
            return
        start_ns = int(started * 1e9) + self._perf_offset
        end_ns = start_ns + int(duration * 1e9)
        step_id = getattr(message, "step_id", None)
        if step_id is None and isinstance(message, StepLogits):
            step_id = message.batch.step_id
        if step_id is not None:
            self._step_span(stage, message, step_id, start_ns, end_ns, queue_wait)
            return
        request_trace = self._owner(message)
        if request_trace is None:
            return
        span = self.tracer.start_span(
            stage,
            context=trace.set_span_in_context(request_trace.root, Context()),
            start_time=start_ns,
            attributes={
                "flowllm.stage": stage,
                "flowllm.queue_wait_s": queue_wait,
                "flowllm.message": type(message).__name__,
            },
        )
        span.end(end_time=end_ns)

    def _owner(self, message: Any) -> _RequestTrace | None:
        if isinstance(message, ValidRequest):
            return self._requests.get(message.request.request_id)
        if isinstance(message, (GenerateRequest, TokenizedRequest, Abort, RequestError)):
            return self._requests.get(message.request_id)
        if isinstance(message, Finish):
            return self._seqs.get(message.seq_id)
        return None

    def _step_span(
        self,
        stage: str,
        message: Any,
        step_id: int,
        start_ns: int,
        end_ns: int,
        queue_wait: float,
    ) -> None:
        links = self._step_links.get(step_id)
        if links is None:
            links = self._links(message)
            if links is None:
                return  # a step before any traced request joined it
            self._step_links[step_id] = links
            while len(self._step_links) > STEP_LINKS_KEPT:
                del self._step_links[next(iter(self._step_links))]
        if isinstance(message, TextDeltas):
            self._observe_chunks(message, start_ns)
        if not links:
            return
        span = self.tracer.start_span(
            f"step {stage}",
            context=Context(),  # a trace of its own: a step serves many requests
            links=links,
            start_time=start_ns,
            attributes={
                "flowllm.stage": stage,
                "flowllm.step_id": step_id,
                "flowllm.queue_wait_s": queue_wait,
                "flowllm.message": type(message).__name__,
            },
        )
        span.end(end_time=end_ns)

    def _links(self, message: Any) -> list[Link] | None:
        """Links to the root spans of the traced requests in a step (None: a message that
        comes before the step's batch was seen, so its sequences are not known yet)."""
        owners: dict[int, _RequestTrace] = {}
        seq_ids = seq_ids_of(message)
        if isinstance(message, TextDeltas):
            for chunk in message.chunks:
                request_trace = self._requests.get(chunk.request_id)
                if request_trace is not None:
                    owners[id(request_trace)] = request_trace
        elif seq_ids is None:
            return None
        else:
            batch = message.batch if isinstance(message, StepLogits) else message
            if isinstance(batch, StepBatch):
                for start in batch.started:
                    request_trace = self._requests.get(start.request_id)
                    if request_trace is not None:
                        request_trace.seq_ids.append(start.seq_id)
                        self._seqs[start.seq_id] = request_trace
            for seq_id in seq_ids:
                request_trace = self._seqs.get(seq_id)
                if request_trace is not None:
                    owners[id(request_trace)] = request_trace
        roots: dict[int, SpanContext] = {}
        for request_trace in owners.values():
            context = request_trace.root.get_span_context()
            roots[context.span_id] = context
        return [Link(context) for context in roots.values()]

    def _observe_chunks(self, message: TextDeltas, start_ns: int) -> None:
        """What the root spans report: token counts, finish reasons, latencies (the
        requests' own monotonic clock, as the latency metrics)."""
        now = (start_ns - self._mono_offset) / 1e9
        for chunk in message.chunks:
            request_trace = self._requests.get(chunk.request_id)
            if request_trace is None:
                continue
            if not request_trace.first_chunk_time:
                request_trace.first_chunk_time = now
            if chunk.scheduled_time and chunk.index == 0:
                request_trace.scheduled_time = chunk.scheduled_time
            request_trace.input_tokens = chunk.num_prompt_tokens
            request_trace.output_tokens[chunk.index] = chunk.num_output_tokens
            if chunk.finish_reason is not None:
                request_trace.finish_reasons[chunk.index] = chunk.finish_reason
                if chunk.index == 0:
                    request_trace.last_chunk_time = now


class TracingMiddleware(ASGIMiddleware):
    """The root span of every HTTP request (outermost, so it also covers refusals)."""

    scopes = (ScopeType.HTTP,)

    def __init__(self, tracing: RequestTracing) -> None:
        self._tracing = tracing

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        tracing = self._tracing
        root = tracing.start_request(scope)
        scope[SCOPE_SPAN] = root  # type: ignore[literal-required]
        status = 0

        async def send_traced(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                for name, value in message.get("headers", ()):
                    if name.lower() == b"x-request-id":
                        root.set_attribute("flowllm.request_id", value.decode("latin-1"))
            await send(message)

        try:
            await next_app(scope, receive, send_traced)
        except Exception as exc:  # answered by the app's exception handlers, outside
            status = status or getattr(exc, "status_code", 500)
            raise
        finally:
            tracing.end_request(root, scope.get(SCOPE_REQUESTS, ()), status)  # type: ignore[arg-type]
