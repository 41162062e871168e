"""vLLM's metric names and labels beside flowllm's, and the per-request metrics vLLM has
(prefill, decode, inference time, inter-token latency, token counts, tokens per step)
measured on a real in-process run against what the request itself reports."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flowllm.async_engine import AsyncEngine
from flowllm.config import engine_config
from flowllm.graph.spans import GraphMetrics
from flowllm.messages import GenerateRequest, SamplingParams
from flowllm.metrics import VLLM_NAMES, EngineMetrics, MetricsView, buckets_1_2_5
from flowllm.stages.services import EngineServices, build_services


def families(registry: CollectorRegistry, prefix: str) -> dict[str, dict]:
    text = generate_latest(MetricsView(registry, prefix, "m").registry()).decode()
    return {
        family.name: {"type": family.type, "samples": family.samples}
        for family in text_string_to_metric_families(text)
    }


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    GraphMetrics(registry)
    metrics = EngineMetrics(registry, max_model_len=100)
    metrics.request_success.labels("stop").inc()
    metrics.time_to_first_token.observe(0.2)
    return registry


def test_both_prefixes_by_default(registry: CollectorRegistry) -> None:
    shown = families(registry, "both")
    for short in VLLM_NAMES:
        name = short.removesuffix("_total") if short != "iteration_tokens_total" else short
        assert f"flowllm:{name}" in shown and f"vllm:{name}" in shown, short
    (vllm_success,) = [
        s for s in shown["vllm:request_success"]["samples"] if s.name.endswith("_total")
    ]
    assert vllm_success.labels == {"model_name": "m", "finished_reason": "stop"}
    assert vllm_success.value == 1
    (flowllm_success,) = [
        s for s in shown["flowllm:request_success"]["samples"] if s.name.endswith("_total")
    ]
    assert flowllm_success.labels == {"finished_reason": "stop"}  # no model_name: as before
    ttft = {
        s.labels.get("le"): s.value
        for s in shown["vllm:time_to_first_token_seconds"]["samples"]
        if s.name.endswith("_bucket")
    }
    assert ttft["0.1"] == 0 and ttft["0.25"] == 1
    assert shown["vllm:time_to_first_token_seconds"]["type"] == "histogram"


def test_each_prefix_alone(registry: CollectorRegistry) -> None:
    vllm = families(registry, "vllm")
    assert not any(name.startswith("flowllm:") and name[8:] in VLLM_NAMES for name in vllm)
    assert "vllm:num_requests_running" in vllm
    # flowllm's own metrics, which vLLM does not have, stay under their names.
    assert {"flowllm:stage_duration_seconds", "flowllm:channel_depth"} <= vllm.keys()
    flowllm = families(registry, "flowllm")
    assert not any(name.startswith("vllm:") for name in flowllm)
    assert "flowllm:num_requests_running" in flowllm
    with pytest.raises(ValueError, match="metrics prefix"):
        MetricsView(registry, "vllm2", "m")


def test_token_buckets() -> None:
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(2048)[-1] == 2000


@pytest.fixture(scope="module")
def services(gpt2_tiny_dir: Path) -> EngineServices:
    return build_services(
        engine_config(str(gpt2_tiny_dir), dtype="float32", kv_cache_memory=1 << 22)
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


def test_per_request_metrics_match_the_request(services: EngineServices) -> None:
    fresh = services.fresh()
    prompt_ids = tuple(range(100, 111))  # 11 prompt tokens
    max_tokens = 6

    async def main() -> list:
        async with AsyncEngine.start(services=fresh) as engine:
            box = engine.submit(
                GenerateRequest(
                    request_id="r1",
                    model=fresh.served_model_name,
                    params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                    arrival_time=anyio.current_time(),
                    prompt_token_ids=prompt_ids,
                )
            )
            return [chunk async for chunk in box]

    chunks = anyio.run(main)
    registry = fresh.registry
    assert chunks[-1].finish_reason == "length"
    assert sample(registry, "flowllm:request_success_total", finished_reason="length") == 1
    assert sample(registry, "flowllm:request_prompt_tokens_sum") == len(prompt_ids)
    assert sample(registry, "flowllm:request_generation_tokens_sum") == max_tokens
    # Every token is computed once but the last one sampled: the prompt and 5 decodes.
    computed = len(prompt_ids) + max_tokens - 1
    assert sample(registry, "flowllm:iteration_tokens_total_sum") == computed
    assert sample(registry, "flowllm:iteration_tokens_total_count") == max_tokens
    # One interval between each two of the chunks the request received.
    assert sample(registry, "flowllm:inter_token_latency_seconds_count") == len(chunks) - 1
    prefill = sample(registry, "flowllm:request_prefill_time_seconds_sum")
    decode = sample(registry, "flowllm:request_decode_time_seconds_sum")
    inference = sample(registry, "flowllm:request_inference_time_seconds_sum")
    queue = sample(registry, "flowllm:request_queue_time_seconds_sum")
    e2e = sample(registry, "flowllm:e2e_request_latency_seconds_sum")
    itl = sample(registry, "flowllm:inter_token_latency_seconds_sum")
    assert prefill > 0 and decode > 0 and queue >= 0
    assert prefill + decode == pytest.approx(inference)
    assert queue + inference == pytest.approx(e2e, abs=1e-3)
    assert itl == pytest.approx(decode)  # the intervals add up to the decode time
