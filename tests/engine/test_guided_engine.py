"""Constrained requests through the whole graph, in process, on the tiny GPT-2: with the
guide stage (n > 1, logprobs, stop strings, prefix caching) and without it (a 400)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from flowllm.config import engine_config
from flowllm.engine.async_engine import AsyncEngine
from flowllm.engine.loading import build_services
from flowllm.graph.spec import GraphSpec
from flowllm.graph.validator import ValidGraph, validate_graph
from flowllm.mailbox import Mailbox, RequestFailed
from flowllm.messages import (
    Chunk,
    GenerateRequest,
    SamplingParams,
    StructuredOutputs,
    merge_by_choice,
)
from flowllm.stages.services import EngineServices

DEFAULT_GRAPH = Path(__file__).resolve().parents[2] / "flowllm" / "engine" / "default.yaml"
ASYNC_GRAPH = Path(__file__).resolve().parents[2] / "examples" / "graphs" / "async-scheduling.yaml"
CODE = StructuredOutputs(regex="[a-z]{3}-[0-9]{2}", param="guided_regex")


@pytest.fixture(scope="module")
def services(gpt2_tiny_dir: Path) -> EngineServices:
    return build_services(
        engine_config(str(gpt2_tiny_dir), dtype="float32", kv_cache_memory=1 << 20)
    )


def request(services: EngineServices, rid: str, prompt: str, **params: Any) -> GenerateRequest:
    return GenerateRequest(
        request_id=rid,
        model=services.served_model_name,
        params=SamplingParams(**params),
        arrival_time=time.monotonic(),
        prompt=prompt,
    )


async def choices(box: Mailbox) -> dict[int, Chunk]:
    return merge_by_choice([chunk async for chunk in box])


def run(
    services: EngineServices, requests: list[GenerateRequest], graph: ValidGraph | None = None
) -> list[Any]:
    """Each request's choices (submitted together), or its error."""

    async def main() -> list[Any]:
        async with AsyncEngine.start(graph=graph, services=services.fresh()) as engine:
            boxes = [engine.submit(r) for r in requests]
            out: list[Any] = []
            for box in boxes:
                try:
                    out.append(await choices(box))
                except RequestFailed as failed:
                    out.append(failed.error)
            return out

    return anyio.run(main)


def test_constraints_hold_with_n_logprobs_and_stop_strings(
    services: EngineServices, gpt2_tokenizer: Any
) -> None:
    n3, stop, free = run(
        services,
        [
            request(services, "n3", "Code:", n=3, seed=1, max_tokens=12, structured_outputs=CODE,
                    logprobs=3),
            request(services, "stop", "Code:", temperature=0.0, max_tokens=12,
                    structured_outputs=CODE, stop=("-",)),
            request(services, "free", "Code:", temperature=0.0, max_tokens=6, ignore_eos=True),
        ],
    )  # fmt: skip
    assert sorted(n3) == [0, 1, 2]
    for chunk in n3.values():
        assert re.fullmatch("[a-z]{3}-[0-9]{2}", chunk.text), chunk.text
        assert chunk.finish_reason == "stop"  # the grammar ended: EOS was the only choice
        # logprobs after the mask: the distribution is over the allowed tokens only, so
        # the first token's alternatives are all lowercase letters and sum to at most 1
        first = chunk.logprobs[0]
        assert all(re.fullmatch("[a-z]+", gpt2_tokenizer.decode([t])) for t, _ in first.top)
        assert sum(torch.tensor([lp for _, lp in first.top]).exp()) <= 1.0 + 1e-5
        last = chunk.logprobs[-1]  # EOS, the only token allowed at the end
        assert last.logprob == pytest.approx(0.0, abs=1e-6)
    (cut,) = stop.values()
    assert re.fullmatch("[a-z]{3}", cut.text) and cut.stop_reason == "-"
    assert free[0].finish_reason == "length" and len(free[0].token_ids) == 6


def test_prefix_caching_changes_nothing_for_a_constraint(services: EngineServices) -> None:
    """The second request, sent after the first finished, finds its prompt's blocks in the
    prefix cache: it computes fewer tokens and generates the same constrained text."""
    prompt = "Code: " * 12

    async def main() -> list[Chunk]:
        async with AsyncEngine.start(services=services.fresh()) as engine:
            out = []
            for rid in ("p0", "p1"):
                params = dict(temperature=0.0, max_tokens=12, structured_outputs=CODE)
                out.append(
                    (await choices(engine.submit(request(services, rid, prompt, **params))))[0]
                )
            hits = engine.services.registry.get_sample_value("flowllm:prefix_cache_hits_total")
            assert hits and hits > 0
            return out

    first, second = anyio.run(main)
    assert first.text == second.text and re.fullmatch("[a-z]{3}-[0-9]{2}", first.text)


def without_guide() -> ValidGraph:
    """The default graph with the guide stage (its two lines) and its two edges removed."""
    lines = DEFAULT_GRAPH.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "flowllm.stages.guide" in line)
    del lines[at : at + 2]
    kept = [line for line in lines if "guide.in" not in line and "guide.out" not in line]
    return validate_graph(GraphSpec.from_yaml("\n".join(kept) + "\n", source="<no guide>"))


def test_a_graph_without_guide_refuses_constraints_and_serves_the_rest(
    services: EngineServices,
) -> None:
    graph = without_guide()
    assert "guide" not in graph.stages and "sample.masks" not in graph.channels
    refused, served = run(
        services,
        [
            request(services, "c", "Code:", max_tokens=8, structured_outputs=CODE),
            request(services, "p", "Code:", temperature=0.0, max_tokens=4, ignore_eos=True),
        ],
        graph,
    )
    assert refused.kind == "invalid_request" and refused.param == "guided_regex"
    assert "guide stage" in refused.message
    assert len(served[0].token_ids) == 4


@pytest.mark.parametrize("graph", [None, ASYNC_GRAPH], ids=["default", "async"])
def test_only_steps_with_a_constrained_sampling_row_carry_masks(
    services: EngineServices, tmp_path: Path, graph: Path | None
) -> None:
    """A constrained request beside longer free ones: guide sends masks for the steps in
    which the constrained sequence samples, and sample samples every other step without
    waiting for any; the outputs equal those of the free requests run alone. Guide gets the
    batches from the first to the one that releases the constrained sequence, and none
    after. With two steps in flight too (masks then often come before their step's
    logits)."""
    from flowllm import LLM
    from flowllm.traces.codec import read_channel

    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in range(2)]
    code = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=CODE)
    prompts = ["Once upon", "The river", "Code:"]
    traced = LLM(services=services.fresh(), trace_dir=tmp_path, graph=graph)
    outputs = traced.generate(prompts, [*free, code])
    alone = LLM(services=services.fresh()).generate(prompts[:2], free)
    assert [o.outputs[0].token_ids for o in outputs[:2]] == [o.outputs[0].token_ids for o in alone]
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", outputs[2].outputs[0].text)
    batches = [e.message for e in read_channel(tmp_path / "execute.in.msgpack")]
    constrained = {s.seq_id for b in batches for s in b.started if s.params.structured_outputs}
    guided = [
        b.step_id for b in batches if any(s.sample and s.seq_id in constrained for s in b.rows)
    ]
    assert [b.step_id for b in batches if b.guided] == guided
    masks = [e.message for e in read_channel(tmp_path / "sample.masks.msgpack")]
    assert [m.step_id for m in masks] == guided
    assert all(m.seq_ids == (next(iter(constrained)),) for m in masks)
    assert len(guided) < len(batches) - 3  # the free sequences ran on without masks
    (seq_id,) = constrained
    steps = [b.step_id for b in batches]
    seen = [e.message.step_id for e in read_channel(tmp_path / "guide.in.msgpack")]
    released = next(b.step_id for b in batches if seq_id in b.released)
    assert seen == steps[steps.index(seen[0]) : steps.index(released) + 1]
    started = next(b.step_id for b in batches if seq_id in {s.seq_id for s in b.started})
    assert seen[0] <= started and steps[-1] > released  # none once it left
