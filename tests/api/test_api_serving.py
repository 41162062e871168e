"""Generation (submit, merge, abort) and completion formatting, without HTTP."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from api_fake_engine import FakeEngine, make_app
from litestar.testing import AsyncTestClient

from flowllm.api.errors import ApiError
from flowllm.api.serving import Generation
from flowllm.mailbox import Mailbox, RequestFailed
from flowllm.messages import Chunk, GenerateRequest, RequestError, SamplingParams


class RecordingEngine:
    """Just enough EngineClient to drive Generation by hand."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.mailboxes: list[Mailbox] = []
        self.aborted: list[str] = []
        self.fail_on = fail_on
        self.refuse: RequestError | None = None
        self.healthy = True

    def submit_all(self, requests: list[GenerateRequest]) -> list[Mailbox]:
        """All or nothing, as ingest admits."""
        if self.fail_on is not None and len(requests) > self.fail_on:
            raise RuntimeError("graph stopped")
        if self.refuse is not None:
            raise RequestFailed(self.refuse)
        boxes = [Mailbox(request.request_id, request.params.n) for request in requests]
        self.mailboxes.extend(boxes)
        return boxes

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def requests(count: int, n: int = 1) -> list[GenerateRequest]:
    params = SamplingParams(n=n)
    return [
        GenerateRequest(request_id=f"r-{i}", model="m", params=params, arrival_time=0, prompt="x")
        for i in range(count)
    ]


def chunk(rid: str, index: int, text: str, finish: Any = None) -> Chunk:
    return Chunk(
        request_id=rid,
        index=index,
        text=text,
        token_ids=(len(text),),
        finish_reason=finish,
        num_output_tokens=1,
    )


@pytest.mark.anyio
async def test_slow_reader_gets_coalesced_chunks() -> None:
    engine = RecordingEngine()
    generation = Generation.submit(engine, requests(2, n=2))  # type: ignore[arg-type]
    first, second = engine.mailboxes
    # The graph delivers everything before the reader looks: nothing blocks, text merges.
    for k in range(50):
        first.put(chunk("r-0", k % 2, "a", "length" if k >= 48 else None))
    second.put(chunk("r-1", 0, "b", "stop"))
    second.put(chunk("r-1", 1, "c", "length"))
    results = await generation.collect()
    assert results[0][0].text == "a" * 25 and results[0][1].text == "a" * 25
    assert results[0][0].finish_reason == "length" and len(results[0][0].token_ids) == 25
    assert (results[1][0].text, results[1][1].text) == ("b", "c")
    generation.close()
    assert engine.aborted == []  # all finished: nothing to abort


@pytest.mark.anyio
async def test_close_aborts_only_unfinished_sub_requests() -> None:
    engine = RecordingEngine()
    generation = Generation.submit(engine, requests(3))  # type: ignore[arg-type]
    engine.mailboxes[1].put(chunk("r-1", 0, "done", "stop"))
    generation.close()
    generation.close()  # idempotent
    assert engine.aborted == ["r-0", "r-2"]


def test_submit_failure_leaves_nothing_running() -> None:
    engine = RecordingEngine(fail_on=2)
    with pytest.raises(RuntimeError):
        Generation.submit(engine, requests(3))  # type: ignore[arg-type]
    assert engine.mailboxes == [] and engine.aborted == []


def test_a_request_that_can_never_be_admitted_is_its_400() -> None:
    engine = RecordingEngine()
    engine.refuse = RequestError(request_id="r-0", message="too many", param="prompt")
    with pytest.raises(ApiError) as refused:
        Generation.submit(engine, requests(3))  # type: ignore[arg-type]
    assert (refused.value.status_code, refused.value.param) == (400, "prompt")
    assert engine.mailboxes == []


def test_unhealthy_engine_refuses_with_500() -> None:
    engine = RecordingEngine()
    engine.healthy = False
    with pytest.raises(ApiError) as refused:
        Generation.submit(engine, requests(1))  # type: ignore[arg-type]
    assert refused.value.status_code == 500
    assert engine.mailboxes == []


@pytest.mark.anyio
async def test_unhealthy_engine_through_http(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    async with AsyncTestClient(make_app(engine)) as client:
        engine.is_healthy = False
        r = await client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "InternalServerError"
        assert (await client.get("/health")).status_code == 503


@pytest.mark.anyio
async def test_pumps_merge_mailboxes_in_arrival_order() -> None:
    engine = RecordingEngine()
    generation = Generation.submit(engine, requests(2))  # type: ignore[arg-type]
    seen: list[tuple[int, str]] = []
    async with anyio.create_task_group() as tg:
        stream = generation.start_pumps(tg)
        engine.mailboxes[1].put(chunk("r-1", 0, "x"))
        engine.mailboxes[0].put(chunk("r-0", 0, "y", "stop"))
        engine.mailboxes[1].put(chunk("r-1", 0, "z", "length"))
        async for prompt_index, item in stream:
            assert isinstance(item, Chunk)
            seen.append((prompt_index, item.text))
    assert sorted(seen) == [(0, "y"), (1, "xz")] or sorted(seen) == [(0, "y"), (1, "x"), (1, "z")]


def test_completion_format_aligns_what_the_engine_leaves_out(tokenizer: Any) -> None:
    """Prompt logprobs sent without the first token's null, generated ones missing: the
    lists stay aligned with the tokens, nulls where nothing was sent."""
    from flowllm.api.completions import CompletionFormat
    from flowllm.api.convert import PreparedCompletion
    from flowllm.api.logprobs import TokenTexts
    from flowllm.messages import TokenLogprobs

    prepared = PreparedCompletion(
        requests=(),
        n=1,
        echo=True,
        echo_only=False,
        logprobs=0,
        prompt_logprobs=None,
        include_usage=False,
    )
    fmt = CompletionFormat(
        prepared, response_id="cmpl-x", created=0, model="m", texts=TokenTexts(tokenizer)
    )
    ids = tuple(tokenizer.encode("one two three"))
    chunk = Chunk(
        request_id="r",
        index=0,
        text=" four five",
        token_ids=(1440, 1936),
        logprobs=(TokenLogprobs(1440, -1.0, 1),),
        prompt_text="one two three",
        prompt_token_ids=ids,
        prompt_logprobs=(TokenLogprobs(ids[1], -2.0, 1), TokenLogprobs(ids[2], -3.0, 1)),
    )
    choice = fmt.choice(0, chunk, first=True, text_offset=0)
    assert choice.text == "one two three four five"
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs == [None, -2.0, -3.0, -1.0, None]
    assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in (*ids, 1440, 1936)]
