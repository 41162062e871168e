"""The ingress's /metrics: every replica's series with a `replica` label, and routing's own.

Each replica's series are its front's here and its core's, fetched as a scrape comes
(`MetricsQuery`, flowllm/engine/core_protocol.py), merged by the front as a front
process merges them; `ReplicaSeries` merges the families of all replicas (one family per
name, as the exposition format wants) and labels every sample with its replica index.
`RoutingMetrics` counts the ingress's routing decisions and the prompt blocks each
decision found on the chosen replica.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from flowllm.metrics import PREFIX
from flowllm.scale_out.replica_link import ReplicaLink
from flowllm.scale_out.router import DECISIONS, Route

REPLICA_LABEL = "replica"


class ReplicaSeries(Collector):
    """The replicas' latest metrics, merged, each sample labelled with its replica."""

    def __init__(self, links: Sequence[ReplicaLink]) -> None:
        self._links = links

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for link in self._links:
            for family in link.front.metrics_registry.collect():
                target = merged.get(family.name)
                if target is None:
                    target = merged[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                replica = str(link.index)
                target.samples.extend(
                    s._replace(labels={**s.labels, REPLICA_LABEL: replica}) for s in family.samples
                )
        yield from merged.values()


class RoutingMetrics:
    """Routing counters and replica gauges, registered in `registry`."""

    def __init__(self, registry: CollectorRegistry, links: Sequence[ReplicaLink]) -> None:
        self.requests = Counter(
            f"{PREFIX}routing_requests",
            "API requests routed to a replica, by routing decision.",
            ["decision"],
            registry=registry,
        )
        self.prefix_queries = Counter(
            f"{PREFIX}routing_prefix_query_blocks",
            "Leading prompt blocks looked up by the router, by routing decision.",
            ["decision"],
            registry=registry,
        )
        self.prefix_hits = Counter(
            f"{PREFIX}routing_prefix_hit_blocks",
            "Leading prompt blocks the chosen replica was sent before, by routing decision.",
            ["decision"],
            registry=registry,
        )
        for decision in DECISIONS:
            for counter in (self.requests, self.prefix_queries, self.prefix_hits):
                counter.labels(decision)
        self.replica_up = Gauge(
            f"{PREFIX}replica_up",
            "1 while the ingress routes to the replica, 0 while it is down.",
            [REPLICA_LABEL],
            registry=registry,
        )
        self.replica_in_flight = Gauge(
            f"{PREFIX}replica_in_flight_requests",
            "Requests (one per prompt) the ingress has sent to the replica and not seen finish.",
            [REPLICA_LABEL],
            registry=registry,
        )
        for link in links:
            index = str(link.index)
            self.replica_up.labels(index).set_function(partial(_up, link))
            self.replica_in_flight.labels(index).set_function(partial(_in_flight, link))

    def observe(self, route: Route) -> None:
        self.requests.labels(route.decision).inc()
        self.prefix_queries.labels(route.decision).inc(route.queried_blocks)
        self.prefix_hits.labels(route.decision).inc(route.matched_blocks)


def _up(link: ReplicaLink) -> float:
    return float(link.healthy)


def _in_flight(link: ReplicaLink) -> float:
    return float(link.in_flight)
