"""`flowllm serve --speculative-config` (tiny GPT-2): completions, whole and streamed, equal
the default server's token for token, and /metrics counts drafts under vLLM's names; with
a draft model (the target drafting for itself, loaded in the engine core) too, every
draft accepted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_helpers import sse_events, start_server
from server_process import TINY_FLAGS, ServerProcess

SPECULATIVE = '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": null}'
# A passage said twice, then its start again: prompt lookup has something to find.
PASSAGE = "The quick brown fox jumps over the lazy dog near the river bank. "
PROMPTS = [PASSAGE * 2 + "The quick brown", "Once upon a time, in a land far away,"]


@pytest.fixture(scope="module")
def spec_server(gpt2_tiny_dir: Path) -> Iterator[ServerProcess]:
    proc = start_server(str(gpt2_tiny_dir), [*TINY_FLAGS, "--speculative-config", SPECULATIVE])
    try:
        yield proc
    finally:
        proc.stop()


def complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    body = {"model": server.model, "max_tokens": 32, "temperature": 0, "logprobs": 1, **body}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_completions_equal_the_default_servers(
    spec_server: ServerProcess, server: ServerProcess
) -> None:
    for prompt in PROMPTS:
        got = complete(spec_server, prompt=prompt)["choices"][0]
        want = complete(server, prompt=prompt)["choices"][0]
        assert (got["text"], got["logprobs"]["tokens"]) == (
            want["text"],
            want["logprobs"]["tokens"],
        )
        seeded = {"temperature": 0.8, "seed": 3, "n": 2}
        got_n = complete(spec_server, prompt=prompt, **seeded)["choices"]
        assert [c["text"] for c in got_n] == [
            c["text"] for c in complete(server, prompt=prompt, **seeded)["choices"]
        ]
    with httpx.stream(
        "POST",
        f"{spec_server.url}/v1/completions",
        json={"model": spec_server.model, "prompt": PROMPTS[0], "max_tokens": 32,
              "temperature": 0, "stream": True},
        timeout=60,
    ) as response:  # fmt: skip
        streamed = "".join(
            e["choices"][0]["text"] for e in sse_events(response)[:-1] if e["choices"]
        )
    assert streamed == complete(server, prompt=PROMPTS[0])["choices"][0]["text"]


def test_a_json_schema_verifies_drafts_under_its_grammar(
    spec_server: ServerProcess, server: ServerProcess
) -> None:
    """A JSON array that repeats itself: lookup drafts from the output, the masks of each
    verified position keep it valid, and the text is the default server's, greedy and
    seeded."""
    schema = {"type": "array", "items": {"enum": ["ab", "cd"]}, "minItems": 12, "maxItems": 12}
    constrained = {"structured_outputs": {"json": schema}, "max_tokens": 80, "logprobs": None}
    before = spec_server.metrics()["flowllm:spec_decode_num_accepted_tokens_total"]
    for sampling in ({"temperature": 0}, {"temperature": 0.8, "seed": 5}):
        got = complete(spec_server, prompt=PROMPTS[1], **constrained, **sampling)["choices"][0]
        want = complete(server, prompt=PROMPTS[1], **constrained, **sampling)["choices"][0]
        assert got["text"] == want["text"]
        items = json.loads(got["text"])
        assert len(items) == 12 and set(items) <= {"ab", "cd"}
    assert spec_server.metrics()["flowllm:spec_decode_num_accepted_tokens_total"] > before


def test_metrics_count_drafts_and_their_acceptance(spec_server: ServerProcess) -> None:
    complete(spec_server, prompt=PROMPTS[0])
    values = spec_server.metrics()
    drafts = values["flowllm:spec_decode_num_draft_tokens_total"]
    assert 0 < values["flowllm:spec_decode_num_accepted_tokens_total"] <= drafts
    text = httpx.get(f"{spec_server.url}/metrics", timeout=5).text
    assert "vllm:spec_decode_num_draft_tokens_total{" in text
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name=" in text
    assert 'position="0"' in text


@pytest.fixture(scope="module")
def draft_server(gpt2_tiny_dir: Path) -> Iterator[ServerProcess]:
    config = {"model": str(gpt2_tiny_dir), "num_speculative_tokens": 4}
    proc = start_server(
        str(gpt2_tiny_dir), [*TINY_FLAGS, "--speculative-config", json.dumps(config)]
    )
    try:
        yield proc
    finally:
        proc.stop()


def test_a_draft_models_completions_equal_the_default_servers(
    draft_server: ServerProcess, server: ServerProcess
) -> None:
    for prompt in PROMPTS:
        got = complete(draft_server, prompt=prompt)["choices"][0]
        want = complete(server, prompt=prompt)["choices"][0]
        assert (got["text"], got["logprobs"]["tokens"]) == (
            want["text"],
            want["logprobs"]["tokens"],
        )
    values = draft_server.metrics()
    drafts = values["flowllm:spec_decode_num_draft_tokens_total"]
    assert values["flowllm:spec_decode_num_accepted_tokens_total"] == drafts > 0
