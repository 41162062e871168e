"""POST /v1/completions against the fake engine: shapes, echo + logprobs, streaming, errors.

Expected outputs are recomputed from the fake engine's rule with the real tokenizer.
"""

from __future__ import annotations

from typing import Any

import pytest
from api_fake_engine import (
    MODEL,
    FakeEngine,
    expected_tokens,
    gen_logprob,
    make_app,
    prompt_logprob,
    sse_events,
)
from litestar.testing import AsyncTestClient

pytestmark = pytest.mark.anyio


async def test_response_shape_n_and_usage(client: AsyncTestClient, tokenizer: Any) -> None:
    prompt = "The quick brown fox"
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3, "n": 2}
    )
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int)
    assert body["model"] == MODEL
    ids = tokenizer.encode(prompt)
    for c, choice in enumerate(body["choices"]):
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", "stop_reason"}
        assert choice["index"] == c
        assert choice["text"] == "".join(tokenizer.decode([t]) for t in expected_tokens(ids, 3, c))
        assert choice["logprobs"] is None
        assert choice["finish_reason"] == "length"
        assert choice["stop_reason"] is None
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 6, "total_tokens": 10}


async def test_prompt_lists_index_choices_across_prompts(
    client: AsyncTestClient, tokenizer: Any, engine: FakeEngine
) -> None:
    prompts = ["one two", "three four five"]
    r = await client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 2, "n": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    for i, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        for c in range(2):
            text = body["choices"][i * 2 + c]["text"]
            assert text == tokenizer.decode(expected_tokens(ids, 2, c))
    # One graph request per prompt, ids cmpl-<uuid>-<i>, model defaulted to the served one.
    sent = engine.submitted
    assert [r.prompt for r in sent] == prompts
    assert sent[0].request_id.endswith("-0") and sent[1].request_id.endswith("-1")
    assert sent[0].request_id[:-2] == sent[1].request_id[:-2] == body["id"]
    assert all(r.model == MODEL for r in sent)
    total_prompt = sum(len(tokenizer.encode(p)) for p in prompts)
    assert body["usage"]["prompt_tokens"] == total_prompt
    assert body["usage"]["completion_tokens"] == 8


@pytest.mark.parametrize("prompt", [[464, 2068, 7586], [[464, 2068], [7586, 21831, 18045]]])
async def test_token_id_prompts(client: AsyncTestClient, engine: FakeEngine, prompt: Any) -> None:
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200
    lists = prompt if isinstance(prompt[0], list) else [prompt]
    assert [req.prompt_token_ids for req in engine.submitted] == [tuple(p) for p in lists]
    assert all(req.prompt is None for req in engine.submitted)
    assert len(r.json()["choices"]) == len(lists)


async def test_sampling_fields_reach_the_graph(client: AsyncTestClient, engine: FakeEngine) -> None:
    body = {
        "prompt": "hi",
        "max_tokens": 5,
        "n": 2,
        "seed": 7,
        "stop": "\n",
        "stop_token_ids": [13],
        "include_stop_str_in_output": True,
        "ignore_eos": True,
        "min_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "presence_penalty": 0.1,
        "frequency_penalty": 0.2,
        "repetition_penalty": 1.1,
        "logit_bias": {"50256": -100},
        "logprobs": 2,
        "prompt_logprobs": 1,
        "skip_special_tokens": False,
        "user": "someone",
    }
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    p = engine.submitted[0].params
    assert (p.max_tokens, p.n, p.seed, p.stop, p.stop_token_ids) == (5, 2, 7, ("\n",), (13,))
    assert p.include_stop_str_in_output and p.ignore_eos and not p.skip_special_tokens
    assert (p.min_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (2, 0.5, 0.9, 40, 0.05)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.1, 0.2, 1.1)
    assert p.logit_bias == {50256: -100.0}
    assert (p.logprobs, p.prompt_logprobs) == (2, 1)


async def test_defaults(client: AsyncTestClient, engine: FakeEngine) -> None:
    await client.post("/v1/completions", json={"prompt": "hi"})
    p = engine.submitted[0].params
    assert p.max_tokens == 16  # the completions default
    assert (p.n, p.temperature, p.top_p, p.top_k, p.stop) == (1, 1.0, 1.0, 0, ())
    assert p.logprobs is None and p.prompt_logprobs is None
    assert not engine.submitted[0].echo


async def test_logprobs_and_text_offset(client: AsyncTestClient, tokenizer: Any) -> None:
    prompt = "Hello there world"
    r = await client.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "logprobs": 2}
    )
    choice = r.json()["choices"][0]
    ids = expected_tokens(tokenizer.encode(prompt), 3, 0)
    tokens = [tokenizer.decode([t]) for t in ids]
    lp = choice["logprobs"]
    assert lp["tokens"] == tokens
    assert lp["token_logprobs"] == [gen_logprob(k, 0) for k in range(3)]
    offsets = [sum(len(t) for t in tokens[:k]) for k in range(3)]
    assert lp["text_offset"] == offsets
    for k, top in enumerate(lp["top_logprobs"]):
        # The fake's top-2: the chosen token, then the next id one nat lower.
        assert top == {
            tokens[k]: gen_logprob(k, 0),
            tokenizer.decode([ids[k] + 1]): gen_logprob(k, 0) - 1,
        }
    assert "".join(tokens) == choice["text"]


@pytest.mark.parametrize("as_ids", [False, True])
async def test_echo_with_logprobs_aligns_prompt_and_generated(
    client: AsyncTestClient, tokenizer: Any, engine: FakeEngine, as_ids: bool
) -> None:
    text = "Paris is the capital of"
    ids = tokenizer.encode(text)
    prompt: Any = ids if as_ids else text
    r = await client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 2, "echo": True, "logprobs": 1},
    )
    choice = r.json()["choices"][0]
    gen = expected_tokens(ids, 2, 0)
    assert choice["text"] == text + tokenizer.decode(gen)
    lp = choice["logprobs"]
    all_ids = ids + gen
    assert lp["tokens"] == [tokenizer.decode([t]) for t in all_ids]
    # Every prompt token has its logprob except the first (null), then the generated ones.
    assert lp["token_logprobs"] == [
        None,
        *(prompt_logprob(j) for j in range(1, len(ids))),
        *(gen_logprob(k, 0) for k in range(2)),
    ]
    assert lp["top_logprobs"][0] is None
    assert all(isinstance(t, dict) for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"][len(ids)] == len(text)
    assert engine.submitted[0].echo
    assert engine.submitted[0].params.prompt_logprobs == 1


async def test_echo_with_max_tokens_zero_returns_only_the_prompt(
    client: AsyncTestClient, tokenizer: Any, engine: FakeEngine
) -> None:
    text = "Only the prompt comes back"
    r = await client.post(
        "/v1/completions",
        json={"prompt": [text, "and this"], "max_tokens": 0, "echo": True, "logprobs": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    first = body["choices"][0]
    assert first["text"] == text
    assert first["finish_reason"] == "length"
    ids = tokenizer.encode(text)
    assert first["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["token_logprobs"]) == len(ids)
    assert body["choices"][1]["text"] == "and this"
    assert body["usage"]["completion_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == len(ids) + len(tokenizer.encode("and this"))
    # The engine ran one step (prompt logprobs need it); its token was dropped.
    assert engine.submitted[0].params.max_tokens == 1


async def test_prompt_logprobs_field(client: AsyncTestClient, tokenizer: Any) -> None:
    text = "a b c"
    r = await client.post(
        "/v1/completions", json={"prompt": text, "max_tokens": 1, "prompt_logprobs": 1}
    )
    choice = r.json()["choices"][0]
    ids = tokenizer.encode(text)
    entries = choice["prompt_logprobs"]
    assert entries[0] is None
    for j in range(1, len(ids)):
        entry = entries[j][str(ids[j])]
        assert entry == {
            "logprob": prompt_logprob(j),
            "rank": 1,
            "decoded_token": tokenizer.decode([ids[j]]),
        }


async def test_stop_token_sets_stop_reason(client: AsyncTestClient, tokenizer: Any) -> None:
    ids = tokenizer.encode("x y z")
    r = await client.post(
        "/v1/completions",
        json={"prompt": ids, "max_tokens": 10, "stop_token_ids": [ids[2]]},
    )
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == ids[2]
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_streaming_equals_whole_and_usage_chunk(
    client: AsyncTestClient, tokenizer: Any
) -> None:
    body = {"prompt": ["alpha beta gamma", "delta"], "max_tokens": 4, "n": 2, "logprobs": 1}
    whole = (await client.post("/v1/completions", json=body)).json()
    r = await client.post(
        "/v1/completions",
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    *chunks, final = events
    texts: dict[int, str] = {}
    tokens: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    for event in chunks:
        assert event["object"] == "text_completion"
        assert event["id"] == events[0]["id"] and event["id"].startswith("cmpl-")
        assert event["usage"] is None
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        tokens.setdefault(choice["index"], []).extend(choice["logprobs"]["tokens"])
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    for choice in whole["choices"]:
        assert texts[choice["index"]] == choice["text"]
        assert tokens[choice["index"]] == choice["logprobs"]["tokens"]
        assert finish[choice["index"]] == choice["finish_reason"]
    assert final["choices"] == []
    assert final["usage"] == whole["usage"]


async def test_streaming_without_usage_has_no_usage_field(client: AsyncTestClient) -> None:
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    events = sse_events(r.text)
    assert events and all("usage" not in e for e in events)
    assert all(e["choices"] for e in events)


@pytest.mark.parametrize("include_usage", [False, True])
async def test_continuous_usage_stats(
    client: AsyncTestClient, tokenizer: Any, include_usage: bool
) -> None:
    """Every chunk carries its choice's usage so far, with its own prompt's tokens (vLLM's
    shape); the last chunk the request's when include_usage is set too."""
    prompts = ["alpha beta gamma", "delta"]
    options = {"continuous_usage_stats": True, "include_usage": include_usage}
    body = {"prompt": prompts, "max_tokens": 4, "n": 2, "stream": True, "stream_options": options}
    events = sse_events((await client.post("/v1/completions", json=body)).text)
    prompt_tokens = [len(tokenizer.encode(p)) for p in prompts]
    so_far = dict.fromkeys(range(4), 0)
    for event in [e for e in events if e["choices"]]:
        (choice,) = event["choices"]
        usage = event["usage"]
        assert usage["prompt_tokens"] == prompt_tokens[choice["index"] // 2]
        assert usage["completion_tokens"] > so_far[choice["index"]]  # one more token each
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        so_far[choice["index"]] = usage["completion_tokens"]
    assert so_far == dict.fromkeys(range(4), 4)
    last = [e["usage"] for e in events if not e["choices"]]
    total = sum(prompt_tokens)
    expected = [{"prompt_tokens": total, "completion_tokens": 16, "total_tokens": total + 16}]
    assert last == (expected if include_usage else [])


async def test_streaming_echo_offsets_continue(client: AsyncTestClient, tokenizer: Any) -> None:
    text = "one two three"
    r = await client.post(
        "/v1/completions",
        json={"prompt": text, "max_tokens": 3, "echo": True, "logprobs": 0, "stream": True},
    )
    events = sse_events(r.text)
    first = events[0]["choices"][0]
    assert first["text"].startswith(text)
    assert first["logprobs"]["token_logprobs"][0] is None
    offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]


async def test_error_after_streaming_began(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, fail_after=2)
    async with AsyncTestClient(make_app(engine)) as client:
        r = await client.post(
            "/v1/completions", json={"prompt": "hello", "max_tokens": 5, "stream": True}
        )
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == {
        "error": {
            "message": "The engine failed.",
            "type": "InternalServerError",
            "param": None,
            "code": None,
        }
    }
    assert all("choices" in e for e in events[:-1]) and len(events) > 1


async def test_engine_failure_without_streaming_is_500(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, fail_after=2)
    async with AsyncTestClient(make_app(engine)) as client:
        r = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "InternalServerError"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [[1], ["a"]]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "n": "two"}, "n"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"max_tokens": 3}, "prompt"),
    ],
)
async def test_request_errors_are_400(client: AsyncTestClient, body: Any, param: str) -> None:
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "BadRequestError"
    assert error["param"] == param


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("temperature", 2.5, "decimal_above_max_value"),
        ("top_p", 0, "decimal_below_min_value"),
        ("top_k", -5, "integer_below_min_value"),
        ("n", 0, "integer_below_min_value"),
        ("logprobs", 21, "integer_above_max_value"),
        ("max_tokens", 0, "integer_below_min_value"),
        ("stop", ["a", ""], "empty_string"),
    ],
)
async def test_range_errors_through_http(
    client: AsyncTestClient, field: str, value: Any, code: str
) -> None:
    for stream in (False, True):
        r = await client.post(
            "/v1/completions", json={"prompt": "hi", field: value, "stream": stream}
        )
        assert r.status_code == 400
        error = r.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("BadRequestError", field, code)


async def test_unknown_model_is_404(client: AsyncTestClient) -> None:
    r = await client.post("/v1/completions", json={"model": "gpt-x", "prompt": "hi"})
    assert r.status_code == 404
    assert r.json()["error"]["message"] == "The model `gpt-x` does not exist."
    assert r.json()["error"]["type"] == "NotFoundError"


async def test_context_length_exceeded(client: AsyncTestClient, tokenizer: Any) -> None:
    prompt = " word" * 250  # 250 tokens; the fake's max_model_len is 256
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith(
        "This model's maximum context length is 256 tokens. However, you requested 10 "
        "output tokens and your prompt contains 250 input tokens"
    )


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[1, 2]",
        b"",
        b'{"prompt": "x", "max_tokens": 1.5}',
        b'{"prompt": "\xc3("}',  # invalid UTF-8 inside a string
        b'{"prompt": "\xed\xa0\x80"}',  # a UTF-16 surrogate encoded as UTF-8
    ],
)
async def test_malformed_bodies(client: AsyncTestClient, content: bytes) -> None:
    r = await client.post(
        "/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "BadRequestError"


async def test_framework_errors_use_the_openai_body(client: AsyncTestClient) -> None:
    r = await client.get("/v1/nothing-here")
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["message"] == "Not Found: GET /v1/nothing-here"
    r = await client.get("/v1/completions")
    assert r.status_code == 405
    assert r.json()["error"]["type"] == "MethodNotAllowedError"


async def test_overload_is_503_with_retry_after(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer, max_pending=1)
    async with AsyncTestClient(make_app(engine)) as client:
        r = await client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1})
    assert r.status_code == 503
    assert r.headers["retry-after"] == "3"
    assert r.json()["error"]["type"] == "ServiceUnavailableError"
    # Admission is all or nothing: no prompt of a refused request was submitted.
    assert engine.submitted == [] and engine.aborted == []


async def test_request_id_header_is_honoured_and_echoed(
    client: AsyncTestClient, engine: FakeEngine
) -> None:
    r = await client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "abc"}
    )
    assert r.headers["x-request-id"] == "abc"
    assert r.json()["id"] == "cmpl-abc"
    # The graph's id stays unique even if clients reuse their ids.
    assert engine.submitted[0].request_id != "cmpl-abc-0"
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.json()["id"] == "cmpl-" + r.headers["x-request-id"]
    r = await client.post("/v1/completions", json={"prompt": "hi", "temperature": 9})
    assert r.status_code == 400 and r.headers["x-request-id"]


async def test_arrival_time_is_stamped(client: AsyncTestClient, engine: FakeEngine) -> None:
    import time

    before, created = time.monotonic(), int(time.time())
    r = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    # arrival_time is on the graph's monotonic clock; `created` is wall-clock seconds.
    assert before <= engine.submitted[0].arrival_time <= time.monotonic()
    assert created <= r.json()["created"] <= time.time()


async def test_null_max_tokens_means_the_rest_of_the_context(
    client: AsyncTestClient, engine: FakeEngine
) -> None:
    r = await client.post(
        "/v1/completions", json={"prompt": "a b", "max_tokens": None, "best_of": 1}
    )
    assert r.status_code == 200
    assert engine.submitted[0].params.max_tokens is None
    assert r.json()["usage"]["total_tokens"] == engine.max_model_len
