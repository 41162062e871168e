"""One span per message a stage handles: its duration and queue wait into the graph's
metrics, a structlog `debug` event, and a call to each of the graph's span sinks.

Spans are cheap by construction: two `perf_counter()` calls, two histogram updates,
and a structlog `debug` event that the filtering logger drops for nothing unless the level
is DEBUG (`FLOWLLM_LOG_LEVEL=debug`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator
from time import perf_counter
from typing import TypedDict

from structlog.typing import FilteringBoundLogger

from flowllm.graph.metrics import GraphMetrics


class MessageFields(TypedDict, total=False):
    """What `message_fields` finds: each key only when the message carries it."""

    request_id: str
    step_id: int
    batch_size: int


def message_fields(message: object) -> MessageFields:
    """What a span says about a message: its request id or step id, and its batch size.

    Per-request messages carry `request_id` (or wrap a request that does); per-step messages
    carry `step_id` (or a `batch` that does) and a sized collection of per-sequence entries.
    """
    fields: MessageFields = {}
    inner = getattr(message, "batch", None) or getattr(message, "request", None)
    for holder in (message, inner):
        if holder is None:
            continue
        request_id = getattr(holder, "request_id", None)
        if request_id is not None:
            fields["request_id"] = request_id
            return fields
        step_id = getattr(holder, "step_id", None)
        if step_id is not None:
            fields["step_id"] = step_id
            for attr in ("rows", "sampled", "seqs", "chunks", "seq_ids"):
                entries = getattr(holder, attr, None)
                if entries is not None:
                    fields["batch_size"] = len(entries)
                    break
            return fields
    return fields


SpanSink = Callable[[str, object, float, float, float], None]
"""Called as `sink(stage, message, started, duration, queue_wait)` for every span (a trace
recorder); must be cheap and never block."""


class SpanSinks:
    """The sinks a graph hands every span to (a trace recorder, a page's request timelines,
    OpenTelemetry export); they may come and go while the graph runs.

    Each stage's `SpanRecorder` reads this collection live, so a sink added before the graph
    runs sees every span, and one added later the spans from then on. `on_change(active)` is
    told as the first sink comes (True) or the last goes (False): a front asks its core for
    the core's spans only while they are read.
    """

    __slots__ = ("_on_change", "_sinks")

    def __init__(self, on_change: Callable[[bool], None] | None = None) -> None:
        self._sinks: list[SpanSink] = []
        self._on_change = on_change

    def add(self, sink: SpanSink) -> None:
        """Also hand every span to `sink`."""
        self._sinks.append(sink)
        if len(self._sinks) == 1 and self._on_change is not None:
            self._on_change(True)

    def remove(self, sink: SpanSink) -> None:
        """Stop handing spans to `sink` (an observer that left): no cost remains."""
        self._sinks.remove(sink)
        if not self._sinks and self._on_change is not None:
            self._on_change(False)

    def relay(
        self, stage: str, message: object, started: float, duration: float, queue_wait: float
    ) -> None:
        """Hand the sinks a span the graph's other process recorded (clocks agree: both
        read the machine's monotonic clock)."""
        for sink in self._sinks:
            sink(stage, message, started, duration, queue_wait)

    def __iter__(self) -> Iterator[SpanSink]:
        return iter(self._sinks)

    def __len__(self) -> int:
        return len(self._sinks)

    def __contains__(self, sink: object) -> bool:
        return sink in self._sinks


class InputClosed:
    """Handed to span sinks as the "message" when a stage sees one of its inputs end (the
    order of ends among messages decides what a multi-input stage such as schedule does)."""

    __slots__ = ("port",)

    def __init__(self, port: str) -> None:
        self.port = port


class SpanRecorder:
    """Records one span per message for one stage: histograms always, events at DEBUG."""

    __slots__ = ("_duration", "_enabled", "_events", "_log", "_sinks", "_wait", "stage")

    def __init__(
        self,
        stage: str,
        log: FilteringBoundLogger,
        metrics: GraphMetrics,
        *,
        enabled: bool = True,
        events: bool | None = None,
        sinks: Collection[SpanSink] = (),  # read live: a graph's `SpanSinks`
    ) -> None:
        self.stage = stage
        self._sinks = sinks
        self._log = log
        self._enabled = enabled
        self._duration = metrics.stage_duration.labels(stage)
        self._wait = metrics.stage_queue_wait.labels(stage)
        if events is None:
            is_enabled_for = getattr(log, "is_enabled_for", None)
            events = bool(is_enabled_for(logging.DEBUG)) if is_enabled_for else True
        self._events = enabled and events

    @property
    def enabled(self) -> bool:
        return self._enabled

    def record(
        self, message: object, started: float, queue_wait: float, *, observed: bool = True
    ) -> None:
        """Close the span of `message`, whose handling began at `started` (perf_counter).

        `observed=False` keeps it out of the duration and wait metrics: a message a stage
        only takes in to join it with another (sample's masks) is not a unit of its work.
        """
        if not self._enabled:
            return
        duration = perf_counter() - started
        if observed:
            self._duration.observe(duration)
            self._wait.observe(queue_wait)
        for sink in self._sinks:
            sink(self.stage, message, started, duration, queue_wait)
        if self._events:
            self._log.debug(
                "span",
                **message_fields(message),
                duration_s=duration,
                queue_wait_s=queue_wait,
            )

    def input_closed(self, port: str) -> None:
        """Tell the sinks that input `port` has closed and drained (no histogram, no event)."""
        if self._enabled and self._sinks:
            now = perf_counter()
            for sink in self._sinks:
                sink(self.stage, InputClosed(port), now, 0.0, 0.0)
