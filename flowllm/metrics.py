"""The serving metrics vLLM users chart: recorded as `flowllm:`, exposed as vLLM names too.

They live in the graph's own CollectorRegistry beside the runtime's per-stage metrics. The
schedule stage updates the engine gauges and the iteration histogram once per step; deliver
observes the per-request latencies and token counts when a request's output arrives and
ends.

Each metric is recorded once. `/metrics` renders the registry through `MetricsView`,
which can also show every engine metric vLLM has under vLLM's name (`vllm:` prefix, with
vLLM's `model_name` label) at scrape time, so the `vllm:` series cost nothing per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from flowllm.graph.metrics import LabelledHistogram

PREFIX = "flowllm:"
VLLM_PREFIX = "vllm:"
METRICS_PREFIXES = ("both", "flowllm", "vllm")

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip
# vLLM's buckets for the time between two output tokens of a request.
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
# Tokens computed in one step (vLLM's iteration_tokens_total buckets).
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class SchedulerCounts(Protocol):
    """What the scheduler reports each step (its SchedulerStats): gauges and cumulative
    counters. A protocol, so that the metrics know nothing of the scheduler."""

    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def kv_cache_usage(self) -> float: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...


class _NoCounts:
    num_running = num_waiting = prefix_cache_queries = prefix_cache_hits = num_preemptions = 0
    kv_cache_usage = 0.0


def buckets_1_2_5(maximum: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `maximum` (vLLM's token-count buckets)."""
    buckets: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > maximum:
                return tuple(buckets)
            buckets.append(float(value))
        exponent += 1


# The engine metrics vLLM also has, by their flowllm name without the prefix: `MetricsView`
# shows these under `vllm:`. The per-stage and channel metrics are flowllm's own.
VLLM_NAMES = frozenset({
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "time_to_first_token_seconds",
    "time_per_output_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
    "spec_decode_num_accepted_tokens_per_pos",
})  # fmt: skip


class EngineMetrics:
    """One set of engine metrics registered in `registry`; `max_model_len` bounds the
    per-request token histograms."""

    def __init__(self, registry: CollectorRegistry, max_model_len: int = 2048) -> None:
        self.registry = registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"{PREFIX}{name}", doc, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, registry=registry)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS
        ) -> Histogram:
            return Histogram(f"{PREFIX}{name}", doc, buckets=buckets, registry=registry)

        self.num_requests_running = gauge("num_requests_running", "Sequences in model steps.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting to run.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV blocks used.")
        self.live_mailboxes = gauge("live_mailboxes", "Requests with an open mailbox.")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found cached.")
        self.num_preemptions = counter("num_preemptions", "Sequences preempted (recompute).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished prefills.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.heap_trims = counter(
            "heap_trims", "Times the heap gave freed memory back after the engine went idle."
        )
        self.request_success = Counter(
            f"{PREFIX}request_success",
            "Requests that finished, by the first choice's finish reason.",
            ["finished_reason"],
            registry=registry,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output chunk."
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Mean time between output tokens of a request."
        )
        # Observed every step (each gap between chunks once, with its count): flowllm's
        # lock-free histogram, a bisect and two adds.
        self.inter_token_latency = LabelledHistogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between two output chunks of a request's first choice.",
            None,
            _ITL_BUCKETS,
            registry,
        ).labels("")
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last output chunk."
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled step."
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled step to first output chunk."
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First output chunk to last output chunk."
        )
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "First scheduled step to last output chunk."
        )
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of a finished request.", token_buckets
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Tokens generated for a finished request's first choice.",
            token_buckets,
        )
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed in one model step.", _ITERATION_BUCKETS
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding)."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted (speculative decoding)."
        )
        self.spec_decode_num_accepted_tokens_per_pos = Counter(
            f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a step's drafts (0 first).",
            ["position"],
            registry=registry,
        )
        self._accepted_at: list[Counter] = []  # the per-position children, by position
        self._last: SchedulerCounts = _NoCounts()

    def observe_verified(self, verified: Iterable[tuple[int, int]]) -> None:
        """Count one step's verified drafts: (drafts, accepted) of each sequence; a
        sequence accepts a prefix of its drafts, so its first `accepted` positions count."""
        at = self._accepted_at
        num_drafts = num_accepted = 0
        for drafts, accepted in verified:
            num_drafts += drafts
            num_accepted += accepted
            while len(at) < accepted:
                at.append(self.spec_decode_num_accepted_tokens_per_pos.labels(str(len(at))))
            for position in range(accepted):
                at[position].inc()
        self.spec_decode_num_draft_tokens.inc(num_drafts)
        self.spec_decode_num_accepted_tokens.inc(num_accepted)

    def observe_scheduler(self, stats: SchedulerCounts) -> None:
        """Set the gauges and advance the counters by what changed since the last call."""
        last = self._last
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self._last = stats


class MetricsView(Collector):
    """What `/metrics` renders of `source`, by `--metrics-prefix`:

    - `flowllm`: every metric under its `flowllm:` name, as recorded;
    - `vllm`: the engine metrics vLLM has under `vllm:` names with a `model_name` label,
      and flowllm's own (per stage, per channel) under `flowllm:`;
    - `both` (the default): every `flowllm:` metric and the `vllm:` ones beside them.
    """

    def __init__(self, source: CollectorRegistry, prefix: str, model_name: str) -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.source = source
        self.prefix = prefix
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            short = family.name.removeprefix(PREFIX)
            in_vllm = family.name.startswith(PREFIX) and short in VLLM_NAMES
            if self.prefix != "vllm" or not in_vllm:
                yield family
            if self.prefix != "flowllm" and in_vllm:
                yield self._as_vllm(family, short)

    def _as_vllm(self, family: Metric, short: str) -> Metric:
        renamed = Metric(VLLM_PREFIX + short, family.documentation, family.type, family.unit)
        for sample in family.samples:
            renamed.samples.append(
                sample._replace(
                    name=VLLM_PREFIX + sample.name.removeprefix(PREFIX),
                    labels={"model_name": self.model_name, **sample.labels},
                )
            )
        return renamed

    def registry(self) -> CollectorRegistry:
        """A registry holding only this view, for `generate_latest`."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return registry


HEALTHY = f"{PREFIX}graph_healthy"


class MergedMetrics(Collector):
    """This process's registry and other processes' latest metrics (Prometheus text) as
    one registry, one family per name: a front's own, its sibling fronts' and the core's.

    Each process counts its own events (a front its requests' latencies, the core its
    steps), so a series several have is their sum; a graph is healthy only while every
    part is, and a counter was created when the first part created it.
    """

    def __init__(self, local: CollectorRegistry, remote_texts: Callable[[], Iterable[str]]) -> None:
        self.local = local
        self.remote_texts = remote_texts

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        index: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Metric, int]] = {}

        def add(family: Metric) -> None:
            target = merged.setdefault(family.name, family)
            for i, sample in enumerate(list(family.samples)):
                key = (sample.name, tuple(sorted(sample.labels.items())))
                found = index.get(key)
                if found is None:
                    if target is not family:
                        target.samples.append(sample)
                        i = len(target.samples) - 1
                    index[key] = (target, i)
                    continue
                owner, i = found
                mine = owner.samples[i]
                if sample.name == HEALTHY or sample.name.endswith("_created"):
                    value = min(sample.value, mine.value)
                else:
                    value = mine.value + sample.value
                owner.samples[i] = mine._replace(value=value)

        for family in self.local.collect():
            add(family)
        for text in self.remote_texts():
            for family in text_string_to_metric_families(text):
                add(family)
        yield from merged.values()
