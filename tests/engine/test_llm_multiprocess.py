"""`LLM(..., multiprocess=True)` runs the default graph as it is placed: the model and the
step loop in an engine core process, the per-request stages here. Its outputs are the
one-process engine's, token for token, greedy and seeded, across several `generate`
calls on one core."""

from __future__ import annotations

from pathlib import Path

import pytest

from flowllm import LLM, SamplingParams

SETTINGS = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory": 16 << 20}
PROMPTS = ["Hello there", "The quick brown fox jumps over", "Once upon a time"]
PARAMS = [
    SamplingParams(max_tokens=12, temperature=0),
    SamplingParams(max_tokens=12, temperature=0.9, seed=99, n=2),
    SamplingParams(max_tokens=12, temperature=0.7, top_k=40, seed=5, logprobs=2),
]


def texts(llm: LLM) -> list[list[tuple[str, list[int]]]]:
    outputs = llm.generate(PROMPTS, PARAMS)
    return [[(c.text, c.token_ids) for c in out.outputs] for out in outputs]


def test_the_core_in_a_child_process_gives_the_same_outputs(gpt2_tiny_dir: Path) -> None:
    expected = texts(LLM(str(gpt2_tiny_dir), **SETTINGS))
    llm = LLM(str(gpt2_tiny_dir), multiprocess=True, **SETTINGS)
    try:
        assert llm._core is not None and llm._core.process.is_alive()
        assert texts(llm) == expected
        assert llm.last_run is not None
        byte_vocab = llm.last_run.byte_vocab()
        assert texts(llm) == expected  # a second call reconnects to the same core
        assert llm.last_run.byte_vocab() is byte_vocab  # its detokenizer's table built once
        # the call's metrics are its front's: the stages that ran here, and their requests'
        assert llm.last_run is not None
        registry = llm.last_run.registry
        delivered = {"stage": "deliver"}
        assert registry.get_sample_value("flowllm:stage_duration_seconds_count", delivered)
        assert registry.get_sample_value("flowllm:time_per_output_token_seconds_count")
        with pytest.raises(TypeError, match="trace records a graph run in one process"):
            LLM(str(gpt2_tiny_dir), multiprocess=True, trace_dir="unused", **SETTINGS)
        with pytest.raises(TypeError, match="core_services makes an engine core process"):
            LLM(str(gpt2_tiny_dir), core_services=print, **SETTINGS)
    finally:
        llm.close()
    assert not llm._core.process.is_alive()
