"""The router's decisions and the replica metrics merge, without Ray: the prompt blocks
against the tokenizer-free rules in flowllm/scale_out/router.py, routing against
hand-set loads, the merged exposition against prometheus_client's own parser."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flowllm.messages import ChatMessage, GenerateRequest, SamplingParams
from flowllm.metrics import EngineMetrics, MergedMetrics, MetricsView
from flowllm.scale_out.replica_link import ReplicaLink
from flowllm.scale_out.replica_metrics import ReplicaSeries, RoutingMetrics
from flowllm.scale_out.router import BYTES_PER_TOKEN, PrefixTable, Router, prompt_blocks

BLOCK = 4


def _request(
    prompt: str | None = None, tokens: tuple[int, ...] | None = None, **kw: object
) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"r{random.random()}",
        model="m",
        params=SamplingParams(),
        arrival_time=time.monotonic(),
        prompt=prompt,
        prompt_token_ids=tokens,
        **kw,  # type: ignore[arg-type]
    )


def test_token_blocks_are_chained_and_only_full_ones_count() -> None:
    a = prompt_blocks(_request(tokens=tuple(range(10))), BLOCK)
    b = prompt_blocks(_request(tokens=(*range(8), 99, 98, 97, 96, 95)), BLOCK)
    assert len(a) == 2 and len(b) == 3  # 10 tokens: 2 full blocks; 13: 3
    assert a == b[:2]  # same leading 8 tokens
    changed_first = prompt_blocks(_request(tokens=(7, *range(1, 10))), BLOCK)
    assert not set(changed_first) & set(a)  # a block's hash covers every block before it
    salted = prompt_blocks(_request(tokens=tuple(range(10)), cache_salt="s"), BLOCK)
    assert not set(salted) & set(a)


def test_text_and_chat_blocks() -> None:
    size = BLOCK * BYTES_PER_TOKEN
    text = "x" * (3 * size + 5)
    assert len(prompt_blocks(_request(prompt=text), BLOCK)) == 3
    assert (
        prompt_blocks(_request(prompt=text), BLOCK)[:2]
        == prompt_blocks(_request(prompt=text[: 2 * size] + "different tail"), BLOCK)[:2]
    )
    chat = _request(messages=(ChatMessage("user", "y" * (2 * size)),))
    assert len(prompt_blocks(chat, BLOCK)) == 2


def test_prefix_table_forgets_least_recently_used() -> None:
    table = PrefixTable(capacity=3)
    table.add([1, 2, 3])
    table.add([1])  # 1 is fresh again: 2 is now the oldest
    table.add([4])
    assert table.match([1]) == 1 and table.match([2]) == 0
    assert table.match([3, 4]) == 2


class _Replica:
    def __init__(self, index: int, in_flight: int = 0) -> None:
        self.index = index
        self.in_flight = in_flight


def test_prefix_affinity_until_loads_differ_too_much() -> None:
    replicas = [_Replica(0), _Replica(1)]
    router = Router("prefix_aware", [100, 100], BLOCK, imbalance_bound=2, rng=random.Random(0))
    shared = tuple(range(12))
    first = router.choose([_request(tokens=(*shared, 50))], replicas)
    assert first.decision == "no_match" and first.queried_blocks == 3
    home = first.replica.index
    replicas[home].in_flight = 2  # within the bound: affinity still decides
    second = router.choose([_request(tokens=(*shared, 60))], replicas)
    assert (second.decision, second.replica.index, second.matched_blocks) == (
        "prefix_match", home, 3,
    )  # fmt: skip
    replicas[home].in_flight = 3  # beyond it: the less loaded of two
    third = router.choose([_request(tokens=(*shared, 70))], replicas)
    assert (third.decision, third.replica.index) == ("imbalanced", 1 - home)


def test_no_match_takes_the_less_loaded_and_restarts_are_forgotten() -> None:
    replicas = [_Replica(0, in_flight=5), _Replica(1, in_flight=0)]
    router = Router("prefix_aware", [100, 100], BLOCK, imbalance_bound=10)
    route = router.choose([_request(tokens=tuple(range(8)))], replicas)
    assert (route.decision, route.replica.index) == ("no_match", 1)
    assert router.choose([_request(tokens=tuple(range(8)))], replicas).decision == "prefix_match"
    router.forget(1)
    assert router.choose([_request(tokens=tuple(range(8)))], replicas).decision == "no_match"


def test_round_robin_takes_turns_among_the_serving() -> None:
    replicas = [_Replica(0), _Replica(1), _Replica(2)]
    router = Router("round_robin", [10, 10, 10], BLOCK, imbalance_bound=0)
    order = [router.choose([_request(prompt="p")], replicas).replica.index for _ in range(4)]
    assert order == [0, 1, 2, 0]
    serving = [replicas[0], replicas[2]]  # replica 1 is down
    order = [router.choose([_request(prompt="p")], serving).replica.index for _ in range(3)]
    assert order == [2, 0, 2]


def test_bad_router_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="routing must be one of"):
        Router("random", [1], BLOCK, 0)
    with pytest.raises(ValueError, match="imbalance bound"):
        Router("round_robin", [1], BLOCK, -1)


def _front(generated: int) -> Any:
    """A replica's front as the ingress holds it: its own registry (requests delivered)
    merged with its core's text (tokens generated), as FrontEngine.metrics_registry is."""
    here, core = CollectorRegistry(), CollectorRegistry()
    EngineMetrics(here).request_success.labels("length").inc()
    EngineMetrics(core).generation_tokens.inc(generated)
    merged = CollectorRegistry(auto_describe=False)
    merged.register(MergedMetrics(here, lambda: [generate_latest(core).decode()]))
    return SimpleNamespace(
        metrics_registry=merged,
        healthy=True,
        services=SimpleNamespace(mailboxes=[]),
        link=SimpleNamespace(core_address="10.0.0.1:4000", ready=None),
    )


def test_replica_series_merge_with_a_replica_label() -> None:
    links = [ReplicaLink(i, f"engine-{i}", _front(g)) for i, g in enumerate((3, 5))]
    ingress = CollectorRegistry(auto_describe=False)
    ingress.register(ReplicaSeries(links))
    RoutingMetrics(ingress, links)
    text = generate_latest(MetricsView(ingress, "both", "m").registry()).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    generated = {
        s.labels["replica"]: s.value
        for s in families["flowllm:generation_tokens"].samples
        if s.name.endswith("_total")
    }
    assert generated == {"0": 3.0, "1": 5.0}
    vllm = [s for s in families["vllm:request_success"].samples if s.name.endswith("_total")]
    assert {(s.labels["replica"], s.labels["model_name"]) for s in vllm} == {("0", "m"), ("1", "m")}
    assert {s.labels["replica"]: s.value for s in families["flowllm:replica_up"].samples} == {
        "0": 1.0,
        "1": 1.0,
    }
    assert text.count("# TYPE flowllm:generation_tokens_total counter") == 1
