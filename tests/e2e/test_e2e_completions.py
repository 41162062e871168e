"""/v1/completions on the real engine (tiny GPT-2, real tokenizer) behind `flowllm serve`.

The oracles are the server's own non-streamed answers (streaming must reproduce them), the
GPT-2 tokenizer (prompt token counts, echoed text), and plain arithmetic on logprobs.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest
from e2e_helpers import sse_events
from server_process import ServerProcess

PROMPT = "The quick brown fox jumps over the lazy dog. Then"


def _complete(server: ServerProcess, **body: Any) -> dict[str, Any]:
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def test_greedy_stream_equals_whole_sync_sdk(server: ServerProcess, gpt2_tokenizer: Any) -> None:
    client = server.client()
    whole = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0
    )
    choice = whole.choices[0]
    assert choice.finish_reason == "length"
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(gpt2_tokenizer.encode(PROMPT))
    assert whole.usage.completion_tokens == 24
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 24
    assert whole.object == "text_completion"
    assert whole.model == server.model

    chunks = list(
        client.completions.create(
            model=server.model,
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert len({c.id for c in chunks}) == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, 24)


@pytest.mark.anyio
async def test_greedy_stream_equals_whole_async_sdk(server: ServerProcess) -> None:
    client = server.async_client()
    whole = await client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=16, temperature=0
    )
    stream = await client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=16, temperature=0, stream=True
    )
    pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert "".join(pieces) == whole.choices[0].text
    assert len(pieces) > 1  # really streamed, not one blob
    await client.close()


def test_raw_sse_format(server: ServerProcess) -> None:
    """The wire format itself: `data: {json}` events, a single `data: [DONE]` last."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    for event in events[:-1]:
        assert event["object"] == "text_completion"
        assert "usage" not in event  # only with stream_options.include_usage
        assert [c["index"] for c in event["choices"]] == [0]
    whole = _complete(server, prompt=PROMPT, max_tokens=8, temperature=0)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole["choices"][0]["text"]


def test_logprobs_shapes(server: ServerProcess) -> None:
    result = _complete(server, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    choice = result["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert [len(lp[k]) for k in lp] == [6, 6, 6, 6]
    assert "".join(lp["tokens"]) == choice["text"]
    # text_offset: where each token starts in the returned text.
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets
    for token, logprob, top in zip(
        lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
    ):
        assert logprob <= 0.0
        assert 3 <= len(top) <= 4  # the top 3, plus the sampled token when it is not among them
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(logprob, max(top.values()), abs_tol=1e-4)
        assert top[token] == pytest.approx(logprob, abs=1e-4)
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-4

    # Streamed logprobs concatenate to the same lists.
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        events = sse_events(response)[:-1]
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    logprobs = [v for e in events for v in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert tokens == lp["tokens"]
    assert logprobs == pytest.approx(lp["token_logprobs"], abs=1e-4)


def test_echo(server: ServerProcess, gpt2_tokenizer: Any) -> None:
    plain = _complete(server, prompt=PROMPT, max_tokens=5, temperature=0)
    echoed = _complete(server, prompt=PROMPT, max_tokens=5, temperature=0, echo=True, logprobs=1)
    choice = echoed["choices"][0]
    assert choice["text"] == PROMPT + plain["choices"][0]["text"]
    lp = choice["logprobs"]
    n_prompt = len(gpt2_tokenizer.encode(PROMPT))
    assert len(lp["tokens"]) == n_prompt + 5
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None and v <= 0 for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"]) == choice["text"]
    # Usage counts generated tokens only.
    assert echoed["usage"]["completion_tokens"] == 5
    assert echoed["usage"]["prompt_tokens"] == n_prompt

    # max_tokens 0 with echo: the prompt alone, scored.
    only = _complete(server, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    assert only["choices"][0]["text"] == PROMPT
    assert len(only["choices"][0]["logprobs"]["tokens"]) == n_prompt
    assert only["usage"]["completion_tokens"] == 0

    # Streamed echo: the first event starts with the prompt.
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        events = sse_events(response)[:-1]
    assert events[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]


def test_n_and_seed_reproducible(server: ServerProcess) -> None:
    client = server.client()
    kwargs: dict[str, Any] = {
        "model": server.model, "prompt": PROMPT, "max_tokens": 12, "n": 2, "seed": 1234,
        "temperature": 1.0,
    }  # fmt: skip
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.choices[0].text != first.choices[1].text  # n samples, not one copied
    assert first.usage is not None and first.usage.completion_tokens == 24
    other = client.completions.create(**{**kwargs, "seed": 4321})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]

    # The same seeded request streamed gives the same two texts.
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in first.choices]


def _varied_output(server: ServerProcess) -> tuple[dict[str, Any], dict[str, Any]]:
    """A deterministic (seeded) request whose text has a substring worth stopping at."""
    request = {"prompt": PROMPT, "max_tokens": 24, "temperature": 1.0, "seed": 7}
    return request, _complete(server, **request)


def test_stop_strings(server: ServerProcess) -> None:
    request, result = _varied_output(server)
    text = result["choices"][0]["text"]
    assert len(text) > 20, text
    middle = len(text) // 2
    stop = text[middle : middle + 4]
    cut = text.index(stop)  # the first occurrence is where generation stops

    stopped = _complete(server, **request, stop=[stop, "never-in-output-xyz"])
    choice = stopped["choices"][0]
    assert choice["text"] == text[:cut]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == stop
    assert stopped["usage"]["completion_tokens"] < 24

    kept = _complete(server, **request, stop=stop, include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == text[: cut + len(stop)]
    assert kept["choices"][0]["stop_reason"] == stop

    # Streaming cuts at the same place.
    body = {**request, "stop": [stop], "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        events = sse_events(response)[:-1]
    assert "".join(e["choices"][0]["text"] for e in events) == text[:cut]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"][0]["stop_reason"] == stop


def test_token_id_prompt_matches_text_prompt(server: ServerProcess, gpt2_tokenizer: Any) -> None:
    ids = gpt2_tokenizer.encode(PROMPT)
    by_text = _complete(server, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = _complete(server, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)
    echoed = _complete(server, prompt=ids, max_tokens=1, temperature=0, echo=True)
    assert echoed["choices"][0]["text"].startswith(PROMPT)


def test_batched_prompts(server: ServerProcess, gpt2_tokenizer: Any) -> None:
    prompts = ["Hello there, my name is", "In the beginning", "1, 2, 3, 4,"]
    singles = [_complete(server, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    batch = _complete(server, prompt=prompts, max_tokens=6, temperature=0, n=2)
    # Choice index = prompt index * n + choice; greedy, so both choices of a prompt agree.
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    for i, single in enumerate(singles):
        for j in range(2):
            assert batch["choices"][2 * i + j]["text"] == single["choices"][0]["text"]
    n_prompt = sum(len(gpt2_tokenizer.encode(p)) for p in prompts)
    assert batch["usage"]["prompt_tokens"] == n_prompt
    assert batch["usage"]["completion_tokens"] == 3 * 2 * 6

    # Token-id arrays batch the same way, streamed this time.
    ids = [gpt2_tokenizer.encode(p) for p in prompts]
    texts: dict[int, str] = {}
    client = server.client()
    for chunk in client.completions.create(
        model=server.model, prompt=ids, max_tokens=6, temperature=0, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == [s["choices"][0]["text"] for s in singles]


def test_sampling_fields(server: ServerProcess, gpt2_tokenizer: Any) -> None:
    """vLLM's extras and OpenAI's knobs reach the sampler: checked against the tokenizer and
    the server's own greedy output."""
    greedy = _complete(server, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    greedy_text = greedy["choices"][0]["text"]
    greedy_ids = gpt2_tokenizer.encode(greedy_text)

    # top_k 1 at temperature 1 is greedy; so is min_p 1.
    assert (
        _complete(server, prompt=PROMPT, max_tokens=6, top_k=1, seed=5)["choices"][0]["text"]
        == greedy_text
    )
    assert (
        _complete(server, prompt=PROMPT, max_tokens=6, min_p=1.0, seed=5)["choices"][0]["text"]
        == greedy_text
    )

    # logit_bias +100 on one token makes it every token.
    forced_id = gpt2_tokenizer.encode(" banana")[0]
    forced = _complete(
        server, prompt=PROMPT, max_tokens=4, logit_bias={str(forced_id): 100}, seed=1
    )
    assert forced["choices"][0]["text"] == gpt2_tokenizer.decode([forced_id] * 4)

    # stop_token_ids: generation ends at that token, reported as the stop reason.
    stop_id = greedy_ids[2]
    first = greedy_ids.index(stop_id)
    stopped = _complete(
        server, prompt=PROMPT, max_tokens=6, temperature=0, stop_token_ids=[stop_id]
    )
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["stop_reason"] == stop_id
    assert stopped["usage"]["completion_tokens"] == first + 1
    assert stopped["choices"][0]["text"] == gpt2_tokenizer.decode(greedy_ids[:first])

    # A strong repetition penalty changes a repetitive greedy continuation.
    penalised = _complete(
        server, prompt=PROMPT, max_tokens=6, temperature=0, repetition_penalty=2.0,
        frequency_penalty=2.0, presence_penalty=2.0,
    )  # fmt: skip
    assert penalised["usage"]["completion_tokens"] == 6

    # prompt_logprobs: one entry per prompt token, the first null.
    n_prompt = len(gpt2_tokenizer.encode(PROMPT))
    scored = _complete(server, prompt=PROMPT, max_tokens=1, prompt_logprobs=2)
    entries = scored["choices"][0]["prompt_logprobs"]
    assert len(entries) == n_prompt and entries[0] is None
    for entry in entries[1:]:
        assert 2 <= len(entry) <= 3
        for value in entry.values():
            assert set(value) == {"logprob", "rank", "decoded_token"} and value["logprob"] <= 0

    # min_tokens with an EOS-only logit bias: EOS is masked until min_tokens are out.
    eos = gpt2_tokenizer.eos_token_id
    early = _complete(server, prompt=PROMPT, max_tokens=8, logit_bias={str(eos): 100})
    assert early["choices"][0]["finish_reason"] == "stop"
    assert early["usage"]["completion_tokens"] == 1
    held = _complete(server, prompt=PROMPT, max_tokens=8, logit_bias={str(eos): 100}, min_tokens=3)
    assert held["usage"]["completion_tokens"] == 4  # three forced-non-EOS tokens, then EOS
    assert held["choices"][0]["finish_reason"] == "stop"
    ignored = _complete(
        server, prompt=PROMPT, max_tokens=5, logit_bias={str(eos): 100}, ignore_eos=True,
        skip_special_tokens=False,
    )  # fmt: skip
    assert ignored["usage"]["completion_tokens"] == 5
    assert ignored["choices"][0]["text"] == "<|endoftext|>" * 5
    assert ignored["choices"][0]["finish_reason"] == "length"
