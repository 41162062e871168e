"""Continuous batching through the whole graph is exact: a request's tokens do not depend
on what else runs beside it, through chunked prefill, preemption and prefix-cache hits."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from flowllm import LLM, SamplingParams
from flowllm.llm import RequestOutput

VOCAB = 50257
ASYNC_GRAPH = Path(__file__).parents[2] / "examples" / "graphs" / "async-scheduling.yaml"
TINY_BLOCK_BYTES = 2 * 2 * 16 * 4 * 16 * 4  # K+V, 2 layers, 16 slots, 4 heads x 16, fp32


def random_prompts(rng: random.Random, count: int, low: int, high: int) -> list[list[int]]:
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(low, high))] for _ in range(count)]


def token_ids(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    return [[o.token_ids for o in out.outputs] for out in outputs]


def metric(llm: LLM, name: str) -> float:
    assert llm.last_run is not None
    value = llm.last_run.registry.get_sample_value(name)
    assert value is not None, name
    return value


def alone(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[list[int]]]:
    return [token_ids(llm.generate([p], sp))[0] for p, sp in zip(prompts, params, strict=True)]


@pytest.fixture(scope="module")
def llm(gpt2_tiny_dir: Path) -> LLM:
    return LLM(
        str(gpt2_tiny_dir),
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=256,  # long prompts are chunked
        kv_cache_memory=4096 * TINY_BLOCK_BYTES,
    )


def test_64_mixed_greedy_requests_batched_equal_each_alone(llm: LLM) -> None:
    rng = random.Random(0)
    prompts = random_prompts(rng, 64, 5, 400)
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24), ignore_eos=True)
        for _ in prompts
    ]
    batched = token_ids(llm.generate(prompts, params))
    assert [len(c[0]) for c in batched] == [p.max_tokens for p in params]
    assert metric(llm, "flowllm:num_preemptions_total") == 0
    assert batched == alone(llm, prompts, params)


def test_seeded_sampling_batched_equals_alone(llm: LLM) -> None:
    rng = random.Random(1)
    prompts = random_prompts(rng, 16, 5, 120)
    params = [
        SamplingParams(
            temperature=0.9, top_p=0.95, top_k=50, seed=i, max_tokens=12, ignore_eos=True
        )
        for i in range(len(prompts))
    ]
    batched = token_ids(llm.generate(prompts, params))
    assert batched == alone(llm, prompts, params)
    assert batched == token_ids(llm.generate(prompts, params))


def test_preemption_keeps_results_exact(gpt2_tiny_dir: Path, llm: LLM) -> None:
    small = LLM(
        str(gpt2_tiny_dir),
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=256,
        kv_cache_memory=48 * TINY_BLOCK_BYTES,  # 768 token slots for 16 growing sequences
    )
    rng = random.Random(2)
    prompts = random_prompts(rng, 16, 40, 200)
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True) for _ in prompts]
    batched = token_ids(small.generate(prompts, params))
    assert metric(small, "flowllm:num_preemptions_total") > 0
    assert batched == token_ids(llm.generate(prompts, params))


def test_shared_prefix_hits_the_cache_and_keeps_results_exact(llm: LLM) -> None:
    rng = random.Random(3)
    prefix = [rng.randrange(VOCAB) for _ in range(256)]
    prompts = [prefix + p for p in random_prompts(rng, 12, 1, 40)]
    params = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True) for _ in prompts]
    batched = token_ids(llm.generate(prompts, params))
    assert metric(llm, "flowllm:prefix_cache_hits_total") > 0
    assert batched == alone(llm, prompts, params)


@pytest.fixture(scope="module")
def async_llm(gpt2_tiny_dir: Path) -> LLM:
    """Two steps in flight with async scheduling (examples/graphs/async-scheduling.yaml)."""
    return LLM(
        str(gpt2_tiny_dir),
        dtype="float32",
        max_model_len=512,
        max_num_batched_tokens=256,
        kv_cache_memory=4096 * TINY_BLOCK_BYTES,
        graph=ASYNC_GRAPH,
    )


def test_two_steps_in_flight_give_the_tokens_of_one(llm: LLM, async_llm: LLM) -> None:
    """Async scheduling (placeholder rows read the ids sampled by the step ahead, stops seen
    a step late) changes no token, logprob or finish: greedy and seeded, penalties, EOS and
    stop ids ending sequences early, max_tokens of 1, n > 1 and a stop string."""
    rng = random.Random(4)
    prompts = random_prompts(rng, 24, 3, 150)
    frequent = [t for p in prompts for t in p[:2]]  # ids likely to come up: stop ids
    params = []
    for i in range(len(prompts)):
        kind = i % 4
        params.append(
            SamplingParams(
                temperature=0.0 if kind == 0 else 0.9,
                seed=None if kind == 0 else i,
                top_k=40 if kind == 2 else 0,
                presence_penalty=0.5 if kind == 3 else 0.0,
                repetition_penalty=1.2 if kind == 3 else 1.0,
                n=2 if kind == 2 else 1,
                max_tokens=rng.choice([1, 2, 7, 20]),
                stop_token_ids=tuple(rng.sample(frequent, 8)) if kind == 1 else (),
                stop=("e",) if kind == 3 else (),
                logprobs=2 if kind == 1 else None,
            )
        )
    with capture_logs() as logs:
        async_out = async_llm.generate(prompts, params)
    # the graph ended by itself: its cycles (schedule's credit, sample's ids) closed in turn
    assert not [e for e in logs if e["event"] == "graph did not drain in time; cancelling"]
    lockstep_out = llm.generate(prompts, params)
    assert metric(async_llm, "flowllm:num_preemptions_total") == 0
    for a, b in zip(async_out, lockstep_out, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
                y.token_ids,
                y.text,
                y.finish_reason,
                y.stop_reason,
            )
            assert x.logprobs == y.logprobs
    finishes = {o.finish_reason for out in async_out for o in out.outputs}
    assert finishes == {"stop", "length"}  # sequences ended early, as well as at max_tokens


def test_an_llm_loads_its_graph_once(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    """The graph file is read and checked when the LLM is built, not on every call: the
    calls run on after it is gone."""
    graph = tmp_path / "graph.yaml"
    graph.write_text(ASYNC_GRAPH.read_text())
    llm = LLM(str(gpt2_tiny_dir), dtype="float32", max_model_len=64, graph=graph)
    graph.unlink()
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first, second = (token_ids(llm.generate([[5, 6, 7]], params)) for _ in range(2))
    assert first == second and len(first[0][0]) == 3


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(stop=None), "$.stop"),  # type: ignore[arg-type]
        (SamplingParams(max_tokens="5"), "$.max_tokens"),  # type: ignore[arg-type]
        (SamplingParams(seed=1.5), "$.seed"),  # type: ignore[arg-type]
    ],
)
def test_a_mistyped_sampling_params_is_refused_and_the_engine_serves_on(
    llm: LLM, params: SamplingParams, field: str
) -> None:
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    before = llm.generate("The quick brown", greedy)[0].outputs[0].token_ids
    with pytest.raises(TypeError, match=re.escape(field)):
        llm.generate(["The quick brown", "Hello"], [greedy, params])
    with pytest.raises(TypeError, match=re.escape(field)):
        llm.chat([{"role": "user", "content": "Hi"}], params)
    assert llm.generate("The quick brown", greedy)[0].outputs[0].token_ids == before


def test_lists_where_tuples_are_declared_are_accepted(llm: LLM) -> None:
    as_list = SamplingParams(max_tokens=8, temperature=0.0, stop=[" the"], stop_token_ids=[13])  # type: ignore[arg-type]
    as_tuple = SamplingParams(max_tokens=8, temperature=0.0, stop=(" the",), stop_token_ids=(13,))
    assert llm.generate("Hello", as_list)[0].outputs[0].text == (
        llm.generate("Hello", as_tuple)[0].outputs[0].text
    )
