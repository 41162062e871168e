"""The bundled model served quantized (the default) is batch invariant on every kernel build
this machine runs: a request's greedy and seeded tokens alone equal its tokens among 7
other requests with prompts of other lengths, through chunked prefill (8 tokens a step),
through a preemption and through a prefix-cache hit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting each of the "
    "one hundred and twelve steps, and lit the lamp before the fishing boats came home."
)
PROBES = [  # (prompt, params): greedy on a prompt of two cache blocks, seeded on a short one
    (STORY + " One night", SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)),
    ("Years later,", SamplingParams(temperature=0.9, seed=99, max_tokens=16, ignore_eos=True)),
]
OTHERS = [  # prompts of other lengths, sampled with their own seeds, some sharing the story
    "Hi",
    "List three colours:",
    STORY,
    "def add(a, b):\n    return",
    "Write a haiku about the sea, the wind, and the long grey evening over the harbour wall.",
    STORY[:60],
]
MAX_MODEL_LEN = 128


def batch_of_8() -> tuple[list[str], list[SamplingParams], list[int]]:
    """The two probes among the six others (each probe thus among 7 others); their
    positions in the batch."""
    prompts = [OTHERS[0], PROBES[0][0], *OTHERS[1:4], PROBES[1][0], *OTHERS[4:]]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True)
        for i in range(len(prompts))
    ]
    at = [1, 5]
    for i, (_, p) in zip(at, PROBES, strict=True):
        params[i] = p
    return prompts, params, at


def tokens(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params)]


def metric(llm: LLM, name: str) -> float:
    assert llm.last_run is not None
    value = llm.last_run.registry.get_sample_value(name)
    assert value is not None, name
    return value


@pytest.fixture
def build(flowllm_cache_with_smollm2: Path, kernel_build: str) -> str:
    """Each kernel build in turn (`kernel_build`), the bundled model in its cache first."""
    return kernel_build


def test_quantized_outputs_do_not_depend_on_the_batch(build: str) -> None:
    llm = LLM("smollm2-135m-instruct", max_model_len=MAX_MODEL_LEN)
    quantized = {type(m.quantized).__name__ for m in llm.services.model.modules()
                 if getattr(m, "quantized", None) is not None}  # fmt: skip
    assert quantized == {"QuantizedLinear"}, build
    alone = [tokens(llm, [p], [sp])[0] for p, sp in PROBES]
    prompts, params, at = batch_of_8()
    together = tokens(llm, prompts, params)
    assert [together[i] for i in at] == alone, "among 7 others, through a prefix-cache hit"
    assert metric(llm, "flowllm:prefix_cache_hits_total") > 0

    # Chunks of 8 tokens, and a cache of 10 blocks for 8 sequences of up to 6 blocks each:
    # the youngest sequences are preempted and recomputed.
    spec = llm.services.kv_caches[0][0]
    block_bytes = 2 * len(llm.services.kv_caches) * spec[0].numel() * spec.element_size()
    small = LLM(
        "smollm2-135m-instruct",
        max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=8,
        kv_cache_memory=10 * block_bytes,
        enable_prefix_caching=False,
    )
    chunked = tokens(small, prompts, params)
    assert metric(small, "flowllm:num_preemptions_total") > 0
    assert [chunked[i] for i in at] == alone, "chunked by 8, through a preemption"
    assert chunked == together  # the others too


def test_quantized_outputs_do_not_depend_on_the_kernels_thread_count(build: str) -> None:
    """The native kernels split no sum between threads, so a step gives the same tokens on
    the model thread's pool of two and on the loop's one thread (where a short step may
    run): a model served on one thread gives the tokens it gives on two, alone and among
    7 others."""
    if build == "torch":
        pytest.skip("torch's own CPU products may split sums by the thread count")
    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            llm = LLM("smollm2-135m-instruct", max_model_len=MAX_MODEL_LEN)
            assert llm.services.model_threads == threads
            alone = [tokens(llm, [p], [sp])[0] for p, sp in PROBES]
            prompts, params, at = batch_of_8()
            together = tokens(llm, prompts, params)
            runs.append((alone, [together[i] for i in at]))
    finally:
        torch.set_num_threads(before)
    (one_alone, one_together), (two_alone, two_together) = runs
    assert one_alone == two_alone, "alone"
    assert one_together == two_together == two_alone, "among 7 others"
