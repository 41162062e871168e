"""The serving metrics vLLM users chart, with the `flowllm:` prefix.

They live in the graph's own CollectorRegistry (rendered by `/metrics`) beside the
runtime's per-stage metrics. The schedule stage updates the engine gauges once per step;
format observes the per-request latencies when a request's output arrives and ends.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flowllm.engine.scheduler import SchedulerStats

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0,
)


class EngineMetrics:
    """One set of engine metrics registered in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"flowllm:{name}", doc, registry=registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"flowllm:{name}", doc, registry=registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(f"flowllm:{name}", doc, buckets=_LATENCY_BUCKETS, registry=registry)

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
        self.request_success = counter("request_success", "Requests that finished.")
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first output chunk."
        )
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Mean time between output tokens of a request."
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to last output chunk."
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled step."
        )
        self._last = SchedulerStats(
            num_running=0,
            num_waiting=0,
            kv_cache_usage=0.0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
        )

    def observe_scheduler(self, stats: SchedulerStats) -> None:
        """Set the gauges and advance the counters by what changed since the last call."""
        last = self._last
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.prefix_cache_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_cache_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self.num_preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self._last = stats
