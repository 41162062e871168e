"""The speculative graph (flowllm/engine/speculative.yaml) through the whole engine: greedy
outputs equal the default graph's token for token, on prompts that repeat themselves (so
drafts are accepted) and ones that do not, through penalties, stops, logprobs, n > 1 and
min_tokens, chunked prefill, prefix-cache hits and preemption; seeded sampled requests
give the default graph's tokens too, and so do constrained ones, whose drafts verify under
their grammar's masks; a large batch steps aside without changing a token."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from model_fixtures import build_tiny_dir

from flowllm import LLM, SamplingParams
from flowllm.llm import RequestOutput
from flowllm.messages import StructuredOutputs

VOCAB = 50257
TINY_BLOCK_BYTES = 2 * 2 * 16 * 4 * 16 * 4  # K+V, 2 layers, 16 slots, 4 heads x 16, fp32
ALWAYS = {"num_speculative_tokens": 4, "disable_by_batch_size": None}


def outputs(out: list[RequestOutput]) -> list[list[tuple[object, ...]]]:
    return [
        [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.logprobs) for o in r.outputs]
        for r in out
    ]


def metric(llm: LLM, name: str) -> float:
    assert llm.last_run is not None
    value = llm.last_run.registry.get_sample_value(name)
    assert value is not None, name
    return value


def accepted(llm: LLM) -> float:
    return metric(llm, "flowllm:spec_decode_num_accepted_tokens_total")


def drafted(llm: LLM) -> float:
    return metric(llm, "flowllm:spec_decode_num_draft_tokens_total")


def prompts_that_repeat(rng: random.Random, count: int) -> list[list[int]]:
    """Half random, half a random phrase said three times: prompt lookup finds the latter."""
    prompts = []
    for i in range(count):
        phrase = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 30))]
        prompts.append(phrase * 3 if i % 2 else phrase + [rng.randrange(VOCAB) for _ in range(9)])
    return prompts


def engines(model: Path, **settings: object) -> tuple[LLM, LLM]:
    common: dict[str, object] = {
        "dtype": "float32",
        "max_model_len": 512,
        "max_num_batched_tokens": 256,
        "kv_cache_memory": 4096 * TINY_BLOCK_BYTES,
        **settings,
    }
    return LLM(str(model), **common), LLM(str(model), speculative_config=ALWAYS, **common)


@pytest.fixture(scope="module")
def gpt2(gpt2_tiny_dir: Path) -> tuple[LLM, LLM]:
    return engines(gpt2_tiny_dir)


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama's layer with a sliding window of 8: the drafts' rows see the window too."""
    return build_tiny_dir(tmp_path_factory.mktemp("mistral"), "mistral")


def test_the_speculative_graph_is_the_one_a_speculative_config_runs(
    gpt2: tuple[LLM, LLM],
) -> None:
    base, spec = gpt2
    assert Path(spec.graph.spec.source).name == "speculative.yaml"
    assert Path(base.graph.spec.source).name == "default.yaml"


@pytest.mark.parametrize("model", ["gpt2", "mistral"])
def test_greedy_outputs_equal_the_default_graphs_and_drafts_are_accepted(
    model: str, gpt2: tuple[LLM, LLM], mistral_dir: Path
) -> None:
    base, spec = gpt2 if model == "gpt2" else engines(mistral_dir)
    rng = random.Random(0)
    prompts = prompts_that_repeat(rng, 16)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = outputs(base.generate(prompts, params))
    assert outputs(spec.generate(prompts, params)) == want
    # drafts accepted, and some rejected: their rows rolled back, the sequence went on
    assert 0 < accepted(spec) < drafted(spec)
    # prompts that never repeat (and a tiny model that may): equal all the same
    plain = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 60))] for _ in range(8)]
    assert outputs(spec.generate(plain, params)) == outputs(base.generate(plain, params))


def test_sampling_parameters_hold_on_the_verified_positions(gpt2: tuple[LLM, LLM]) -> None:
    """Greedy requests with penalties, stop ids and strings, logprobs, min_tokens and
    n > 1 give the default graph's tokens, logprobs and finishes; so do seeded sampled
    requests (each position draws the uniform it would draw without drafts)."""
    base, spec = gpt2
    rng = random.Random(4)
    prompts = prompts_that_repeat(rng, 24)
    frequent = [t for p in prompts for t in p[:2]]
    greedy, seeded = [], []
    for i in range(len(prompts)):
        kind = i % 4
        max_tokens = rng.choice([1, 2, 7, 30])
        greedy.append(
            SamplingParams(
                temperature=0.0,
                presence_penalty=0.5 if kind == 3 else 0.0,
                repetition_penalty=1.2 if kind == 3 else 1.0,
                frequency_penalty=0.3 if kind == 2 else 0.0,
                n=2 if kind == 2 else 1,
                max_tokens=max_tokens,
                min_tokens=min(3, max_tokens) if kind == 1 else 0,
                stop_token_ids=tuple(rng.sample(frequent, 8)) if kind == 1 else (),
                stop=("e",) if kind == 3 else (),
                logprobs=2 if kind in (0, 1) else None,
            )
        )
        # a random tiny model's distributions are nearly flat: only a low temperature keeps
        # drafts at times (the others reject theirs)
        seeded.append(
            SamplingParams(temperature=0.9 if kind else 0.001, seed=i, top_k=40 if kind == 2 else 0,
                           n=2 if kind == 2 else 1, max_tokens=30, logprobs=1)
        )  # fmt: skip
    got = outputs(spec.generate(prompts, greedy))
    assert accepted(spec) > 0
    assert got == outputs(base.generate(prompts, greedy))
    assert {o[2] for r in got for o in r} == {"stop", "length"}
    got = outputs(spec.generate(prompts, seeded))
    assert accepted(spec) > 0
    assert got == outputs(base.generate(prompts, seeded))


def test_prefix_cache_hits_and_preemption_keep_greedy_outputs_exact(
    gpt2_tiny_dir: Path, gpt2: tuple[LLM, LLM]
) -> None:
    base, _ = gpt2
    _, small = engines(gpt2_tiny_dir, kv_cache_memory=48 * TINY_BLOCK_BYTES)
    rng = random.Random(2)
    prefix = [rng.randrange(VOCAB) for _ in range(64)]
    prompts = [prefix + p for p in prompts_that_repeat(rng, 16)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = outputs(small.generate(prompts, params))
    assert metric(small, "flowllm:num_preemptions_total") > 0
    assert metric(small, "flowllm:prefix_cache_hits_total") > 0
    assert accepted(small) > 0
    assert got == outputs(base.generate(prompts, params))


def test_a_large_batch_steps_aside_and_changes_no_token(
    gpt2_tiny_dir: Path, gpt2: tuple[LLM, LLM]
) -> None:
    base, always = gpt2
    adaptive = LLM(
        str(gpt2_tiny_dir), dtype="float32", max_model_len=512,
        speculative_config={"num_speculative_tokens": 4, "disable_by_batch_size": 4},
    )  # fmt: skip
    prompts = prompts_that_repeat(random.Random(5), 12)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 4 * i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    want = outputs(base.generate(prompts, params))
    assert outputs(adaptive.generate(prompts, params)) == want
    assert outputs(always.generate(prompts, params)) == want
    # drafts only once the batch has shrunk to 4 sequences
    assert 0 < drafted(adaptive) < drafted(always)


def test_constrained_requests_take_drafts_each_position_under_its_grammar(
    gpt2: tuple[LLM, LLM],
) -> None:
    """Constrained sequences take drafts too: guide masks each verified position, so a draft
    the grammar forbids (the prompts' tokens) is rejected where it stands and an allowed one
    (the output repeating itself) can be accepted. Greedy and seeded outputs equal the
    default graph's and match their grammar, beside unconstrained sequences."""
    base, spec = gpt2
    rng = random.Random(6)
    prompts = prompts_that_repeat(rng, 12)
    pattern = "(ab|cd|ef)+-[0-9]{2}"
    prefix = "(ab|cd|ef)*[ace]?|(ab|cd|ef)+-[0-9]?"  # where max_tokens may cut it
    code = StructuredOutputs(regex=pattern)
    for sampled in (False, True):
        params = [
            SamplingParams(
                temperature=0.9 if sampled else 0.0, seed=i if sampled else None, max_tokens=40,
                ignore_eos=i % 3 == 0, structured_outputs=code if i % 3 else None,
            )
            for i in range(len(prompts))
        ]  # fmt: skip
        got = outputs(spec.generate(prompts, params))
        assert got == outputs(base.generate(prompts, params))
        for i in range(1, len(prompts)):
            if i % 3:
                _, text, finish, *_ = got[i][0]
                assert re.fullmatch(pattern if finish == "stop" else prefix, str(text)), text
    # constrained sequences alone, on prompts where "ab" twice is followed by tokens the
    # grammar forbids: once the output says "abab", lookup drafts those (rejected by the
    # mask), and later the output's own repeats (accepted)
    ab = spec.tokenizer.encode("ab")
    crafted = [
        [*(rng.randrange(VOCAB) for _ in range(8)), *ab, *ab,
         *(rng.randrange(VOCAB) for _ in range(12))]
        for _ in range(8)
    ]  # fmt: skip
    constrained = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=code)] * 8
    got = outputs(spec.generate(crafted, constrained))
    assert 0 < accepted(spec) < drafted(spec)
    assert got == outputs(base.generate(crafted, constrained))
