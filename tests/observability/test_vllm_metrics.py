"""vLLM's metric names and labels beside flowllm's, and the per-request metrics vLLM has
(prefill, decode, inference time, inter-token latency, token counts, tokens per step)
measured on a real in-process run against what the request itself reports."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from litestar.testing import AsyncTestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flowllm.api.app import create_app
from flowllm.cli import build_parser
from flowllm.config import engine_config
from flowllm.engine.async_engine import AsyncEngine
from flowllm.engine.loading import build_services
from flowllm.graph.metrics import GraphMetrics
from flowllm.messages import GenerateRequest, SamplingParams
from flowllm.metrics import VLLM_NAMES, EngineMetrics, MergedMetrics, MetricsView, buckets_1_2_5
from flowllm.stages.services import EngineServices


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


def test_inter_token_latency_counts_every_request_of_a_shared_step(
    services: EngineServices,
) -> None:
    """Requests decoding in the same steps share their gaps, which deliver observes once
    with a count: each request's intervals are still all there, adding up to its decode."""
    fresh = services.fresh()
    max_tokens = [6, 4, 6]

    async def main() -> list[list]:
        async with AsyncEngine.start(services=fresh) as engine:
            boxes = [
                engine.submit(
                    GenerateRequest(
                        request_id=f"r{i}",
                        model=fresh.served_model_name,
                        params=SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                        arrival_time=anyio.current_time(),
                        prompt_token_ids=tuple(range(100 + i, 111 + i)),
                    )
                )
                for i, n in enumerate(max_tokens)
            ]
            outputs = []
            for box in boxes:
                outputs.append([chunk async for chunk in box])
            return outputs

    outputs = anyio.run(main)
    registry = fresh.registry
    assert [sum(len(c.token_ids) for c in chunks) for chunks in outputs] == max_tokens
    # one chunk delivered per token (merged for the reader since): a gap between each two
    intervals = sum(n - 1 for n in max_tokens)
    assert sample(registry, "flowllm:inter_token_latency_seconds_count") == intervals
    itl = sample(registry, "flowllm:inter_token_latency_seconds_sum")
    decode = sample(registry, "flowllm:request_decode_time_seconds_sum")
    assert itl == pytest.approx(decode)


@pytest.mark.anyio
@pytest.mark.parametrize("prefix", ["vllm", "flowllm", "both"])
async def test_metrics_route_renders_the_chosen_prefix(
    services: EngineServices, prefix: str
) -> None:
    @asynccontextmanager
    async def engine() -> AsyncIterator[AsyncEngine]:
        async with AsyncEngine.start(services=services.fresh()) as running:
            yield running

    app = create_app(engine, served_model_name="tiny-name", metrics_prefix=prefix)
    async with AsyncTestClient(app) as client:
        text = (await client.get("/metrics")).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert ("vllm:num_requests_running" in names) == (prefix != "flowllm")
    assert ("flowllm:num_requests_running" in names) == (prefix != "vllm")
    assert "flowllm:stage_duration_seconds" in names  # flowllm's own, under every prefix
    if prefix != "flowllm":
        assert 'vllm:num_requests_running{model_name="' in text


def test_serve_flag_defaults_to_both_prefixes() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).metrics_prefix == "both"
    assert parser.parse_args(["serve", "--metrics-prefix", "vllm"]).metrics_prefix == "vllm"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--metrics-prefix", "prometheus"])


def test_setup_installs_the_plot_and_tracing_extras() -> None:
    """`make setup` installs the extras that bring matplotlib (`bench serve --plot`) and
    OpenTelemetry (`--otlp-traces-endpoint`)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    repo = Path(__file__).resolve().parents[2]
    extras = tomllib.loads((repo / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    makefile = (repo / "Makefile").read_text()
    (installed,) = re.findall(r"pip install -q -e '\.\[([a-z,]+)\]'", makefile)
    chosen = [dep for extra in installed.split(",") for dep in extras[extra]]
    assert any(dep.startswith("matplotlib") for dep in chosen)
    assert any(dep.startswith("opentelemetry-exporter-otlp-proto-http") for dep in chosen)


def test_merged_metrics_sum_every_process_and_keep_the_worst_health() -> None:
    """A front's /metrics over its own registry, a sibling front's and the core's: equal
    counts are two processes' counts (summed, never taken once), health is the worst
    part's, and a counter was created when its first part was."""
    here, sibling, core = (CollectorRegistry() for _ in range(3))
    for registry in (here, sibling):
        EngineMetrics(registry).request_success.labels("stop").inc(3)
        GraphMetrics(registry).graph_healthy.set(1)
    EngineMetrics(core).generation_tokens.inc(7)
    GraphMetrics(core).graph_healthy.set(0)
    merged = CollectorRegistry(auto_describe=False)
    merged.register(
        MergedMetrics(here, lambda: [generate_latest(r).decode() for r in (sibling, core)])
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(merged).decode())
        for s in family.samples
    }
    assert samples[("flowllm:request_success_total", (("finished_reason", "stop"),))] == 6.0
    assert samples[("flowllm:generation_tokens_total", ())] == 7.0
    assert samples[("flowllm:graph_healthy", ())] == 0.0
    created = samples[("flowllm:request_success_created", (("finished_reason", "stop"),))]
    assert 1e9 < created < 1e10  # a time, not a sum of times
