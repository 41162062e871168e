"""Per-request spans of recent requests, for the page's request timeline (a waterfall).

A span sink on the running graph, attached only while a page watches (`LiveFeed` adds and
removes it), so a server without an open page pays nothing. Each span goes to the
requests its message concerns: per-request messages name theirs; step messages reach
them through their sequences (a sequence's request is learnt from the `started` list of
the step that began it). Everything is bounded: the last `max_requests` requests, at
most `max_spans` spans each, at most `max_sequences` known sequences.

`events(request_id)` answers in the trace-event form `flowllm trace view` exports
(`flowllm/traces/timeline.py`), so one renderer draws both.
"""

from __future__ import annotations

from collections import OrderedDict
from time import perf_counter
from typing import Any

from flowllm.graph.spans import InputClosed, message_fields
from flowllm.messages import seq_ids_of
from flowllm.traces.trace_events import span_slice, stage_tracks

MAX_REQUESTS = 64
MAX_SPANS = 8192  # per request: a few spans per generated token
MAX_SEQUENCES = 8192


class _Span:
    """What the timeline keeps of a span: never the message, which may hold tensors."""

    __slots__ = ("batch_size", "duration", "kind", "queue_wait", "stage", "started", "step_id")

    def __init__(
        self, stage: str, message: Any, started: float, duration: float, queue_wait: float
    ) -> None:
        self.stage = stage
        self.started = started
        self.duration = duration
        self.queue_wait = queue_wait
        self.kind = type(message).__name__
        fields = message_fields(message)
        self.step_id: int | None = fields.get("step_id")
        self.batch_size: int | None = fields.get("batch_size")


class RequestTimelines:
    """The spans of the most recent requests (see the module doc); call it as a SpanSink."""

    def __init__(
        self,
        stages: list[str],
        graph_name: str,
        *,
        max_requests: int = MAX_REQUESTS,
        max_spans: int = MAX_SPANS,
        max_sequences: int = MAX_SEQUENCES,
    ) -> None:
        self._tids = {name: i + 1 for i, name in enumerate(stages)}
        self._graph_name = graph_name
        self._max_requests = max_requests
        self._max_spans = max_spans
        self._max_sequences = max_sequences
        self._requests: OrderedDict[str, list[_Span]] = OrderedDict()
        self._truncated: set[str] = set()
        self._sequences: OrderedDict[int, str] = OrderedDict()  # seq id -> request id

    def __call__(
        self, stage: str, message: Any, started: float, duration: float, queue_wait: float
    ) -> None:
        if isinstance(message, InputClosed):
            return
        request_ids = self._requests_of(message)
        if not request_ids:
            return
        span = _Span(stage, message, started, duration, queue_wait)
        for request_id in request_ids:
            self._add(request_id, span)

    def _requests_of(self, message: Any) -> set[str]:
        request_id = getattr(message, "request_id", None)
        if request_id is not None:
            return {request_id}
        inner = getattr(message, "request", None)
        if inner is not None:
            return {inner.request_id}
        chunks = getattr(message, "chunks", None)
        if chunks is not None:
            return {chunk.request_id for chunk in chunks}
        holder = getattr(message, "batch", message)
        for start in getattr(holder, "started", ()):
            self._learn(start.seq_id, start.request_id)
        found: set[str] = set()
        for step_seq_id in seq_ids_of(holder) or ():
            request_id = self._sequences.get(step_seq_id)
            if request_id is not None:
                found.add(request_id)
        seq_id = getattr(message, "seq_id", None)  # a Finish
        if seq_id is not None and seq_id in self._sequences:
            found.add(self._sequences[seq_id])
        return found

    def _learn(self, seq_id: int, request_id: str) -> None:
        self._sequences[seq_id] = request_id
        if len(self._sequences) > self._max_sequences:
            self._sequences.popitem(last=False)

    def _add(self, request_id: str, span: _Span) -> None:
        spans = self._requests.get(request_id)
        if spans is None:
            spans = self._requests[request_id] = []
            if len(self._requests) > self._max_requests:
                gone, _ = self._requests.popitem(last=False)
                self._truncated.discard(gone)
        if len(spans) < self._max_spans:
            spans.append(span)
        else:
            self._truncated.add(request_id)

    def request_ids(self) -> list[str]:
        """The requests held, oldest first."""
        return list(self._requests)

    def events(self, request_id: str) -> dict[str, Any] | None:
        """The request's spans as trace-event JSON (µs from its first span); None if unknown."""
        spans = self._requests.get(request_id)
        if spans is None:
            return None
        t0 = min(span.started - span.queue_wait for span in spans)
        events = stage_tracks(self._graph_name, self._tids)
        for span in spans:
            events.append(
                span_slice(
                    span.stage,
                    kind=span.kind,
                    batch_size=span.batch_size,
                    ts=round((span.started - t0) * 1e6, 3),
                    duration=span.duration,
                    queue_wait=span.queue_wait,
                    request_ids=[request_id],
                    step_id=span.step_id,
                    tid=self._tids.get(span.stage, 0),
                )
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "graph": self._graph_name,
                "request_id": request_id,
                "truncated": request_id in self._truncated,
                "age_s": round(perf_counter() - t0, 3),
            },
        }
