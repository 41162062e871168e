"""Fault injection into each of the nine stages of the default graph, in process.

A faulty twin of one stage raises, hangs or slows down at its first message, which is
the victim's (the engine runs one sequence at a time, so the others wait behind it; guide
sees only constrained requests, so its victim is one). The
victim gets its error within 2 s, the other requests complete with the tokens a clean
graph gives them, the step loop restarts when it was hit, later requests succeed, and
nothing is left behind. Failing at every message escalates: the graph stops.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from fault_stages import FAULTS, Fault, InjectedFault, fault_graph

from flowllm.config import engine_config
from flowllm.engine.async_engine import AsyncEngine
from flowllm.engine.loading import build_services
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import ValidGraph, validate_graph
from flowllm.mailbox import Mailbox, RequestFailed
from flowllm.messages import GenerateRequest, SamplingParams, StructuredOutputs
from flowllm.stages.services import EngineServices

HERE = Path(__file__).resolve().parent
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CONSTRAINED = SamplingParams(
    max_tokens=6,
    temperature=0.0,
    structured_outputs=StructuredOutputs(regex="[a-z]{3}", param="guided_regex"),
)
PROMPTS = ["The victim", "Alpha beta", "Gamma delta", "Epsilon zeta"]
STEP_LOOP = ("schedule", "execute", "guide", "sample")


@pytest.fixture(scope="module")
def services(gpt2_tiny_dir: Path) -> EngineServices:
    """One sequence at a time, so requests behind the victim are still waiting."""
    config = engine_config(
        str(gpt2_tiny_dir), dtype="float32", kv_cache_memory=1 << 20, max_num_seqs=1
    )
    return build_services(config)


@pytest.fixture(autouse=True)
def no_faults() -> Iterator[None]:
    FAULTS.clear()
    yield
    FAULTS.clear()


def graph(stage: str, **options: Any) -> ValidGraph:
    text = fault_graph(stage, **options)
    return validate_graph(GraphSpec.from_yaml(text, source="<faults>", base_dir=HERE))


async def tokens_of(box: Mailbox) -> list[int]:
    out: list[int] = []
    async for chunk in box:
        out.extend(chunk.token_ids)
    return out


def make(
    services: EngineServices, i: int, prompt: str, params: SamplingParams = GREEDY
) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"r{i}-{time.monotonic_ns()}",
        model=services.served_model_name,
        params=params,
        arrival_time=time.monotonic(),
        prompt=prompt,
    )


@pytest.fixture(scope="module")
def expected(services: EngineServices) -> list[list[int]]:
    """What a clean graph answers each prompt."""

    async def main() -> list[list[int]]:
        async with AsyncEngine.start(services=services.fresh()) as engine:
            return [await tokens_of(engine.submit(make(services, i, p))) for i, p in
                    enumerate(PROMPTS)]  # fmt: skip

    return anyio.run(main)


def metric(engine: AsyncEngine, name: str, labels: dict[str, str] | None = None) -> float:
    return engine.services.registry.get_sample_value(name, labels or {}) or 0.0


async def settled(engine: AsyncEngine) -> None:
    """Healthy, no request state left anywhere, and every KV block free (within 2 s)."""
    with anyio.fail_after(2):
        while (
            not engine.healthy
            or metric(engine, "flowllm:live_mailboxes")
            or metric(engine, "flowllm:kv_cache_usage_perc")
            or any(
                metric(engine, "flowllm:live_sequences", {"stage": s})
                for s in ("schedule", "guide", "sample", "detokenize")
            )
        ):
            await anyio.sleep(0.02)


CASES = [
    ("validate", "raise"),
    ("tokenize", "hang"),
    ("schedule", "raise"),
    ("execute", "hang"),
    ("guide", "raise"),
    ("sample", "raise"),
    ("sample", "slow"),
    ("detokenize", "raise"),
    ("deliver", "hang"),
]


@pytest.mark.parametrize(("stage", "kind"), CASES)
def test_a_fault_fails_the_victim_only(
    services: EngineServices, expected: list[list[int]], stage: str, kind: str
) -> None:
    FAULTS[stage] = Fault(at=1, kind=kind)
    valid = graph(stage, timeout_s=0.5 if kind == "hang" else None)

    async def main() -> None:
        with anyio.fail_after(30):
            await scenario()

    async def scenario() -> None:
        async with AsyncEngine.start(graph=valid, services=services.fresh()) as engine:
            victim = CONSTRAINED if stage == "guide" else GREEDY
            boxes = [engine.submit(make(services, 0, PROMPTS[0], victim))]
            boxes += [engine.submit(make(services, i, p)) for i, p in enumerate(PROMPTS[1:], 1)]
            if kind == "slow":
                assert await tokens_of(boxes[0]) == expected[0]
            else:  # a hang fails its request only through the watchdog
                with pytest.raises(RequestFailed) as failed:
                    await tokens_of(boxes[0])
                assert failed.value.error.kind == "internal"
            others = [await tokens_of(box) for box in boxes[1:]]
            assert others == expected[1:]
            later = await tokens_of(engine.submit(make(services, 9, PROMPTS[0])))
            assert later == expected[0]
            assert FAULTS[stage].hits == 1
            errors = metric(engine, "flowllm:stage_errors_total", {"stage": stage})
            assert errors == (0 if kind == "slow" else 1)
            restarts = metric(engine, "flowllm:stage_restarts_total", {"group": "step_loop"})
            assert restarts == (1 if stage in STEP_LOOP and kind != "slow" else 0)
            await settled(engine)

    anyio.run(main)


def test_a_fault_in_ingest_refuses_that_request_only(
    services: EngineServices, expected: list[list[int]]
) -> None:
    FAULTS["ingest"] = Fault(at=1)
    valid = graph("ingest")

    async def main() -> None:
        async with AsyncEngine.start(graph=valid, services=services.fresh()) as engine:
            with pytest.raises(InjectedFault):
                engine.submit(make(services, 0, PROMPTS[0]))
            boxes = [engine.submit(make(services, i, p)) for i, p in enumerate(PROMPTS)]
            assert [await tokens_of(box) for box in boxes] == expected
            await settled(engine)

    anyio.run(main)


@pytest.mark.parametrize("stage", ["tokenize", "execute"])
def test_repeated_failures_escalate(services: EngineServices, stage: str) -> None:
    FAULTS[stage] = Fault(at=1, every=True)
    valid = graph(stage, max_restarts=2)

    async def main() -> None:
        async with AsyncEngine.start(graph=valid, services=services.fresh()) as engine:
            boxes = [engine.submit(make(services, i, p)) for i, p in enumerate(PROMPTS * 2)]
            with anyio.fail_after(10):
                await engine.graph.wait_finished()
            assert engine.graph.failed and not engine.healthy and not engine.accepting
            assert engine.graph.failure is not None
            assert engine.graph.failure.stage == stage
            for box in boxes:  # every request was answered, none hangs
                with anyio.fail_after(1), pytest.raises(RequestFailed):
                    await tokens_of(box)
            assert FAULTS[stage].hits == 3  # two tolerated, the third escalated

    anyio.run(main)


def test_a_detokenize_failure_ends_the_victims_sequence_in_schedule(
    services: EngineServices,
) -> None:
    """detokenize fails on the victim's first step, before it knows the sequence: it still
    tells schedule to end it, so the victim does not go on generating unread tokens."""
    FAULTS["detokenize"] = Fault(at=1)
    valid = graph("detokenize")
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)

    async def main() -> None:
        async with AsyncEngine.start(graph=valid, services=services.fresh()) as engine:
            victim = GenerateRequest(
                request_id="victim",
                model=services.served_model_name,
                params=long,
                arrival_time=time.monotonic(),
                prompt=PROMPTS[0],
            )
            with anyio.fail_after(30), pytest.raises(RequestFailed):
                await tokens_of(engine.submit(victim))
            await settled(engine)
            generated = metric(engine, "flowllm:generation_tokens_total")
            assert generated < 50, f"the victim ran on: {generated} tokens generated"

    anyio.run(main)


def test_a_restart_after_served_requests_keeps_the_counters_counting(
    services: EngineServices, expected: list[list[int]]
) -> None:
    """The fresh scheduler goes on from the old one's counters (starting again from zero
    made the metrics' increment negative, which failed every step loop after it), and the
    sequences released in the batch the old loop failed on are released downstream too
    (detokenize kept the first request's state)."""
    valid = graph("sample")

    async def main() -> None:
        with anyio.fail_after(30):
            async with AsyncEngine.start(graph=valid, services=services.fresh()) as engine:
                first = await tokens_of(engine.submit(make(services, 0, PROMPTS[1])))
                assert first == expected[1]
                queries = metric(engine, "flowllm:prefix_cache_queries_total")
                assert queries > 0
                FAULTS["sample"] = Fault(at=1)  # its next message: the victim's, or one of none
                try:
                    victim = await tokens_of(engine.submit(make(services, 1, PROMPTS[0])))
                except RequestFailed as failed:
                    assert failed.error.kind == "internal"
                else:
                    assert victim == expected[0]
                later = await tokens_of(engine.submit(make(services, 2, PROMPTS[2])))
                assert later == expected[2]
                restarts = metric(engine, "flowllm:stage_restarts_total", {"group": "step_loop"})
                assert restarts == 1
                assert metric(engine, "flowllm:prefix_cache_queries_total") > queries
                await settled(engine)

    anyio.run(main)
