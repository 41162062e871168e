"""The live view of a running graph: its shape once, then a snapshot of its numbers a second.

Nothing here runs unless a page subscribes. A snapshot is computed when a subscriber asks
for one (several subscribers share a snapshot younger than half the interval), from what
the graph measures anyway: the stage-duration histograms (messages, busy time, p50 over
the last interval), the error and restart counters, each channel's depth, and the
engine's gauges. The first subscriber attaches the request timelines' span sink and the
last one removes it. At most `max_subscribers` connect at once; one more is refused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from time import monotonic, time
from typing import Any

from prometheus_client import Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from flowllm.graph.runtime import Graph
from flowllm.metrics import PREFIX, EngineMetrics
from flowllm.ui.timelines import RequestTimelines

INTERVAL_S = 1.0
MAX_SUBSCRIBERS = 8


class FeedFull(Exception):
    """Every subscriber slot is taken."""


@dataclass
class _Sample:
    """Cumulative counts at one instant, the base of the next snapshot's rates."""

    at: float
    counts: dict[str, list[int]]  # stage -> histogram bucket counts (not cumulative)
    busy: dict[str, float]  # stage -> seconds spent handling messages
    generated: float  # tokens generated


def _value(metric: Counter | Gauge, **labels: str) -> float:
    """The current value of one sample of a prometheus_client metric (0 if absent)."""
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


class _Elsewhere:
    """The other process's latest metrics, looked up by sample name and labels."""

    def __init__(self, text: str) -> None:
        self._samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                self._samples.setdefault(sample.name, []).append((sample.labels, sample.value))

    def value(self, name: str, **labels: str) -> float:
        for have, value in self._samples.get(name, ()):
            if all(have.get(k) == v for k, v in labels.items()):
                return value
        return 0.0

    def durations(self, stage: str, buckets: int) -> tuple[list[int], float]:
        """A stage's duration histogram: per-bucket counts (not cumulative), and its sum."""
        cumulative = [
            int(value)
            for labels, value in self._samples.get(f"{PREFIX}stage_duration_seconds_bucket", ())
            if labels.get("stage") == stage
        ]
        if len(cumulative) != buckets:
            return [0] * buckets, 0.0
        counts = [b - a for a, b in zip([0, *cumulative[:-1]], cumulative, strict=True)]
        return counts, self.value(f"{PREFIX}stage_duration_seconds_sum", stage=stage)


def quantile(bounds: tuple[float, ...], counts: list[int], q: float) -> float | None:
    """The q-quantile of a histogram (per-bucket counts, last is +Inf), interpolated
    linearly within its bucket as Prometheus' histogram_quantile does; None if empty."""
    total = sum(counts)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(counts):
        if count and seen + count >= rank:
            if i == len(bounds):  # the +Inf bucket: its lower bound is the best estimate
                return bounds[-1]
            lower = bounds[i - 1] if i > 0 else 0.0
            return lower + (bounds[i] - lower) * (rank - seen) / count
        seen += count
    return bounds[-1]


class LiveFeed:
    """Snapshots of one running graph for the page (see the module doc)."""

    def __init__(
        self,
        graph: Graph,
        engine_metrics: EngineMetrics | None,
        *,
        elsewhere: Callable[[], Awaitable[str]] | None = None,
        interval_s: float = INTERVAL_S,
        max_subscribers: int = MAX_SUBSCRIBERS,
    ) -> None:
        self.graph = graph
        self.engine_metrics = engine_metrics
        # The metrics of the graph's other process (Prometheus text), for the stages and
        # channels that run there; None when the whole graph runs here.
        self.elsewhere = elsewhere
        self.interval_s = interval_s
        self.max_subscribers = max_subscribers
        self.timelines = RequestTimelines(list(graph.spec.stages), graph.name)
        self.subscribers = 0
        self._last: _Sample | None = None
        self._snapshot: dict[str, Any] | None = None
        self._snapshot_at = 0.0

    # -- the graph's shape ----------------------------------------------------------------

    def shape(self) -> dict[str, Any]:
        """Stages (ports, replicas, supervision group) and edges, as the YAML declares them."""
        spec = self.graph.spec
        stages = []
        for name, bound in spec.stages.items():
            stages.append(
                {
                    "name": name,
                    "process": spec.placement.get(name),
                    "use": bound.spec.use,
                    "replicas": bound.spec.replicas,
                    "group": bound.supervision.group,
                    "on_error": bound.supervision.on_error,
                    "inputs": list(bound.cls.inputs),
                    "outputs": list(bound.cls.outputs),
                }
            )
        edges = [
            {
                "from": producer.stage,
                "port": producer.port,
                "to": channel.dst.stage,
                "in": channel.dst.port,
                "channel": name,
                "capacity": channel.capacity,
            }
            for name, channel in spec.channels.items()
            for producer in channel.producers
        ]
        return {
            "name": spec.name,
            "source": Path(spec.spec.source).name,
            "stages": stages,
            "edges": edges,
            "interval_s": self.interval_s,
        }

    # -- subscribers ----------------------------------------------------------------------

    @property
    def full(self) -> bool:
        return self.subscribers >= self.max_subscribers

    @contextmanager
    def subscribe(self) -> Iterator[None]:
        """Hold a subscriber slot for the body; raises FeedFull when none is free."""
        if self.full:
            raise FeedFull(f"at most {self.max_subscribers} live views may be open at once")
        self.subscribers += 1
        if self.subscribers == 1:
            self.graph.span_sinks.add(self.timelines)
        try:
            yield
        finally:
            self.subscribers -= 1
            if self.subscribers == 0:
                self.graph.span_sinks.remove(self.timelines)
                self._last = None  # rates restart from the next subscriber's first look

    # -- snapshots ------------------------------------------------------------------------

    async def snapshot(self) -> dict[str, Any]:
        """The numbers now; rates and p50 cover the time since the previous snapshot."""
        if self._snapshot is not None and monotonic() - self._snapshot_at < self.interval_s / 2:
            return self._snapshot
        there = await self.elsewhere() if self.elsewhere is not None else ""
        now = monotonic()
        self._snapshot = self._compute(now, _Elsewhere(there))
        self._snapshot_at = now
        return self._snapshot

    def _compute(self, now: float, there: _Elsewhere) -> dict[str, Any]:
        graph = self.graph
        metrics = graph.metrics
        durations = metrics.stage_duration
        sample = _Sample(now, {}, {}, 0.0)
        last = self._last
        elapsed = now - last.at if last is not None else 0.0
        stages: dict[str, Any] = {}
        for name, bound in graph.spec.stages.items():
            group = bound.supervision.group
            if graph.placement.runs_here(name):
                series = durations.labels(name)
                counts, busy_s = list(series.counts), series.sum
                errors = _value(metrics.stage_errors, stage=name)
                restarts = _value(metrics.stage_restarts, group=group)
            else:
                counts, busy_s = there.durations(name, len(durations.buckets) + 1)
                errors = there.value(f"{PREFIX}stage_errors_total", stage=name)
                restarts = there.value(f"{PREFIX}stage_restarts_total", group=group)
            sample.counts[name] = counts
            sample.busy[name] = busy_s
            entry: dict[str, Any] = {
                "messages": sum(counts),
                "errors": int(errors),
                "restarts": int(restarts),
                "busy": None,
                "rate": None,
                "p50_s": None,
            }
            if last is not None and elapsed > 0:
                window = [c - p for c, p in zip(counts, last.counts[name], strict=True)]
                busy = (busy_s - last.busy[name]) / elapsed / bound.spec.replicas
                entry["busy"] = min(1.0, max(0.0, busy))
                entry["rate"] = sum(window) / elapsed
                entry["p50_s"] = quantile(durations.buckets, window, 0.5)
            stages[name] = entry
        channels = {
            name: {
                "depth": (graph.channels[name].depth() if name in graph.channels else 0)
                + int(there.value(f"{PREFIX}channel_depth", channel=name)),
                "capacity": channel.capacity,
            }
            for name, channel in graph.spec.channels.items()
        }
        engine: dict[str, Any] = {}
        if self.engine_metrics is not None:
            em = self.engine_metrics
            sample.generated = _value(em.generation_tokens) + there.value(
                f"{PREFIX}generation_tokens_total"
            )
            engine = {
                "running": _value(em.num_requests_running)
                + there.value(f"{PREFIX}num_requests_running"),
                "waiting": _value(em.num_requests_waiting)
                + there.value(f"{PREFIX}num_requests_waiting"),
                "kv_cache_usage": _value(em.kv_cache_usage_perc)
                + there.value(f"{PREFIX}kv_cache_usage_perc"),
                "generated_tokens": sample.generated,
                "tokens_per_s": (
                    (sample.generated - last.generated) / elapsed
                    if last is not None and elapsed > 0
                    else None
                ),
            }
        self._last = sample
        return {
            "time": time(),
            "healthy": graph.healthy,
            "stages": stages,
            "channels": channels,
            "engine": engine,
            "subscribers": self.subscribers,
        }
