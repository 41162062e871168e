"""The runtime's per-stage metrics, in a `CollectorRegistry` owned by each graph, never the
process-wide default, so many graphs can run in one process (tests) and `/metrics` renders
exactly one graph's registry."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from flowllm.graph.channel import Channel

if TYPE_CHECKING:
    from flowllm.graph.remote import RemoteChannel

# Stage durations span from a few µs (a relay) to seconds (a prefill on CPU).
DURATION_BUCKETS = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class HistogramSeries:
    """One label value's histogram: a bisect and two additions per observation."""

    __slots__ = ("_bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; last is +Inf
        self.sum = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        """`times` observations of `value` (equal values: one bisect)."""
        self.counts[bisect_left(self._bounds, value)] += times
        self.sum += value * times


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
                # prometheus_client leaves floatToGoString unannotated.
                cumulative.append((floatToGoString(bound), total))  # type: ignore[no-untyped-call]
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

    def watch_channel(self, channel: Channel[Any] | RemoteChannel) -> None:
        """Sample the channel's depth at scrape time (no cost per message)."""
        self.channel_depth.labels(channel.name).set_function(channel.depth)
