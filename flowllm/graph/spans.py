"""Observability for the graph: structlog setup, one span per handled message, metrics.

Spans are cheap by construction: two `perf_counter()` calls, two histogram updates,
and a structlog `debug` event that the filtering logger drops for nothing unless the level
is DEBUG (`FLOWLLM_LOG_LEVEL=debug`). Metrics live in a `CollectorRegistry` owned by each
graph, never the process-wide default, so many graphs can run in one process (tests) and
`/metrics` renders exactly one graph's registry.
"""

from __future__ import annotations

import logging
import os
import sys
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from time import perf_counter
from typing import Any, TextIO

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from flowllm.graph.channel import Channel

LOG_FORMATS = ("auto", "console", "json")

# Stage durations span from a few µs (a relay) to seconds (a prefill on CPU).
DURATION_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


def configure_logging(
    *,
    fmt: str | None = None,
    level: str | int | None = None,
    stream: TextIO | None = None,
    force: bool = False,
    capture_stdlib: bool = False,
) -> None:
    """Set structlog up once: console on a TTY, JSON lines otherwise.

    `fmt` ("auto", "console", "json") and `level` default to the environment variables
    FLOWLLM_LOG_FORMAT and FLOWLLM_LOG_LEVEL, then to "auto" and "info". Without `force`, an
    existing structlog configuration (the application's own) is left alone.
    `capture_stdlib` (the server) also renders the standard library's log records, such as
    uvicorn's access and error logs, and Python's warnings, the same way, so that every
    line of the process is one format.
    """
    if structlog.is_configured() and not force:
        return
    out = stream if stream is not None else sys.stderr
    fmt = (fmt or os.environ.get("FLOWLLM_LOG_FORMAT") or "auto").lower()
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {fmt!r}")
    if fmt == "auto":
        fmt = "console" if out.isatty() else "json"
    raw_level = level if level is not None else os.environ.get("FLOWLLM_LOG_LEVEL", "info")
    numeric = raw_level if isinstance(raw_level, int) else logging.getLevelName(raw_level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {raw_level!r}")
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: list[Any] = (
        [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
        if fmt == "json"
        else [structlog.dev.ConsoleRenderer(colors=out.isatty())]
    )
    structlog.configure(
        processors=shared + renderer,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    if capture_stdlib:
        _capture_stdlib(shared, renderer, numeric, out)


class _StructlogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root handler `configure_logging` installs (replaced when it runs again)."""


def _capture_stdlib(shared: list[Any], renderer: list[Any], level: int, out: TextIO) -> None:
    handler = _StructlogHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, _access_fields],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
            pass_foreign_args=True,
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StructlogHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    logging.captureWarnings(True)


def _access_fields(logger: Any, method: str, event: dict[str, Any]) -> dict[str, Any]:
    """uvicorn's access line as fields too (client, method, path, status)."""
    args = event.pop("positional_args", None)
    record = event.get("_record")
    if record is not None and record.name == "uvicorn.access" and len(args or ()) == 5:
        client, http_method, path, version, status = args
        event.update(
            client=client, method=http_method, path=path, http_version=version, status=status
        )
    return event


def message_fields(message: Any) -> dict[str, Any]:
    """What a span says about a message: its request id or step id, and its batch size.

    Per-request messages carry `request_id` (or wrap a request that does); per-step messages
    carry `step_id` (or a `batch` that does) and a tuple of per-sequence entries.
    """
    fields: dict[str, Any] = {}
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
            for attr in ("seqs", "tokens", "chunks", "deltas", "seq_ids"):
                entries = getattr(holder, attr, None)
                if entries is not None:
                    fields["batch_size"] = len(entries)
                    break
            return fields
    return fields


class HistogramSeries:
    """One label value's histogram: a bisect and two additions per observation."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self._bounds, value)] += 1
        self.sum += value


class LabelledHistogram(Collector):
    """A Prometheus histogram with one label (or none: `label` None, one series under
    `labels("")`), cheap enough to observe per message.

    prometheus_client's own Histogram takes a lock and walks its buckets on every
    observation, which costs more than a channel hop; this one is updated from the event
    loop only and turned into cumulative buckets when the registry is scraped.
    """

    def __init__(
        self,
        name: str,
        documentation: str,
        label: str | None,
        buckets: tuple[float, ...],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.label = label
        self.buckets = tuple(sorted(buckets))
        self._series: dict[str, HistogramSeries] = {}
        registry.register(self)

    def labels(self, value: str) -> HistogramSeries:
        series = self._series.get(value)
        if series is None:
            series = self._series[value] = HistogramSeries(self.buckets)
        return series

    def describe(self) -> Iterator[HistogramMetricFamily]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self._label_names)

    @property
    def _label_names(self) -> list[str]:
        return [self.label] if self.label is not None else []

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self._label_names)
        for value, series in list(self._series.items()):
            cumulative, total = [], 0
            for bound, count in zip((*self.buckets, float("inf")), series.counts, strict=True):
                total += count
                cumulative.append((floatToGoString(bound), total))
            labels = [value] if self.label is not None else []
            family.add_metric(labels, cumulative, sum_value=series.sum)
        yield family


class GraphMetrics:
    """The Prometheus metrics of one graph, in a registry the graph owns."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.stage_duration = LabelledHistogram(
            "flowllm:stage_duration_seconds",
            "Time a stage spends handling one message.",
            "stage",
            DURATION_BUCKETS,
            self.registry,
        )
        self.stage_queue_wait = LabelledHistogram(
            "flowllm:stage_queue_wait_seconds",
            "Time a message waits in a stage's input channel.",
            "stage",
            DURATION_BUCKETS,
            self.registry,
        )
        self.channel_depth = Gauge(
            "flowllm:channel_depth",
            "Messages buffered in a channel (sampled when scraped).",
            ["channel"],
            registry=self.registry,
        )
        self.stage_errors = Counter(
            "flowllm:stage_errors_total",
            "Exceptions raised by a stage.",
            ["stage"],
            registry=self.registry,
        )
        self.stage_restarts = Counter(
            "flowllm:stage_restarts_total",
            "Restarts of a supervision group after a failure.",
            ["group"],
            registry=self.registry,
        )
        self.live_sequences = Gauge(
            "flowllm:live_sequences",
            "Sequences whose state a stage holds (sampled when scraped).",
            ["stage"],
            registry=self.registry,
        )
        self.graph_healthy = Gauge(
            "flowllm:graph_healthy",
            "1 while the graph runs and serves: no group restarting, no stage overdue.",
            registry=self.registry,
        )

    def watch_channel(self, channel: Channel[Any]) -> None:
        """Sample the channel's depth at scrape time (no cost per message)."""
        self.channel_depth.labels(channel.name).set_function(channel.depth)


SpanSink = Callable[[str, Any, float, float, float], None]
"""Called as `sink(stage, message, started, duration, queue_wait)` for every span (a trace
recorder); must be cheap and never block."""


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
        log: Any,
        metrics: GraphMetrics,
        *,
        enabled: bool = True,
        events: bool | None = None,
        sinks: Sequence[SpanSink] = (),
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
        self, message: Any, started: float, queue_wait: float, *, observed: bool = True
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

    def span(self, message: Any, queue_wait: float) -> Span:
        """A context manager timing the handling of `message` (for hand-written `run`s)."""
        return Span(self, message, queue_wait)


class Span:
    """`with ctx.span(message):` — times the block and records it on exit without error."""

    __slots__ = ("_message", "_recorder", "_started", "_wait")

    def __init__(self, recorder: SpanRecorder, message: Any, queue_wait: float) -> None:
        self._recorder = recorder
        self._message = message
        self._wait = queue_wait
        self._started = 0.0

    def __enter__(self) -> Span:
        self._started = perf_counter()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._recorder.record(self._message, self._started, self._wait)
