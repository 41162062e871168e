"""A tiny random model of each architecture built on Llama's layer (Mistral, SmolLM3, Phi-3,
Gemma 2, Gemma 3, and the mixtures of experts Qwen3-MoE, OLMoE and Mixtral:
tests/model_fixtures.py) behind `flowllm serve` with the default graph,
through the openai SDK: a greedy completion is transformers' greedy continuation on the
same checkpoint (its prompt and output longer than the sliding windows), and a streamed
chat answer is the whole one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_helpers import start_server
from model_fixtures import TINY_ARCHITECTURES, build_tiny_dir, greedy_continuation
from server_process import TINY_FLAGS, ServerProcess

PROMPT = "The quick brown fox jumps over the lazy dog. Then the dog"
NEW_TOKENS = 12


@pytest.fixture(scope="module", params=list(TINY_ARCHITECTURES))
def arch_server(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    chat_template_file: Path,
) -> Iterator[tuple[Path, ServerProcess]]:
    model_dir = build_tiny_dir(tmp_path_factory.mktemp(f"tiny-{request.param}"), request.param)
    proc = start_server(str(model_dir), [*TINY_FLAGS, "--chat-template", str(chat_template_file)])
    try:
        yield model_dir, proc
    finally:
        proc.stop()


def test_greedy_completion_is_transformers(
    arch_server: tuple[Path, ServerProcess], gpt2_tokenizer: Any
) -> None:
    model_dir, server = arch_server
    client = server.client()
    whole = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    prompt_ids = gpt2_tokenizer.encode(PROMPT)
    assert whole.usage is not None and whole.usage.completion_tokens == NEW_TOKENS
    assert whole.usage.prompt_tokens == len(prompt_ids)
    want = gpt2_tokenizer.decode(greedy_continuation(model_dir, prompt_ids, NEW_TOKENS))
    assert whole.choices[0].text == want


def test_streamed_chat_is_the_whole_answer(arch_server: tuple[Path, ServerProcess]) -> None:
    _, server = arch_server
    client = server.client()
    messages = [{"role": "user", "content": "Name three colours of the sea at dusk."}]
    options: dict[str, Any] = {"model": server.model, "max_tokens": 16, "temperature": 0}
    whole = client.chat.completions.create(messages=messages, **options)
    chunks = client.chat.completions.create(messages=messages, stream=True, **options)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert whole.choices[0].finish_reason in ("length", "stop")
