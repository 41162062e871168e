"""ingest admits the prompts of one API request as a whole, by their true cost (prompts x n),
and refuses what could never be admitted with a 400 before allocating anything."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from flowllm.config import engine_config
from flowllm.graph.channel import Channel
from flowllm.graph.stage import Outbox, StageContext
from flowllm.llm import LLM
from flowllm.mailbox import Mailboxes, Overloaded, RequestFailed
from flowllm.messages import Abort, GenerateRequest, SamplingParams
from flowllm.stages.ingest import Ingest, IngestParams


def make_ingest(
    max_pending: int = 8, capacity: int = 4, **limits: Any
) -> tuple[Ingest, Channel[Any]]:
    services = SimpleNamespace(
        config=engine_config(**limits), max_model_len=512, mailboxes=Mailboxes()
    )
    stage = Ingest(IngestParams(max_pending=max_pending), services)  # type: ignore[arg-type]
    channel: Channel[Any] = Channel("ingest.out", GenerateRequest | Abort, capacity)
    ctx = StageContext(
        name="ingest",
        replica=0,
        inboxes={},
        outboxes={"out": Outbox("out", [channel.sender()])},
        log=None,
        spans=None,  # type: ignore[arg-type]
        stop_requested=anyio.Event(),
    )
    stage.bind(ctx)
    return stage, channel


def prompts(count: int, n: int = 1, prefix: str = "r") -> list[GenerateRequest]:
    return [
        GenerateRequest(
            request_id=f"{prefix}-{i}",
            model="m",
            params=SamplingParams(n=n),
            arrival_time=0.0,
            prompt="hi",
        )
        for i in range(count)
    ]


def refused(stage: Ingest, requests: list[GenerateRequest]) -> Any:
    with pytest.raises(RequestFailed) as failed:
        stage.submit_all(requests)
    return failed.value.error


@pytest.mark.anyio
async def test_pending_choices_not_requests_are_bounded() -> None:
    stage, channel = make_ingest(max_pending=8)
    stage.submit_all(prompts(1, n=6, prefix="a"))
    with pytest.raises(Overloaded):  # 6 + 4 > 8: refused now, may fit later
        stage.submit_all(prompts(1, n=4, prefix="b"))
    assert not stage.full  # room for 2 choices
    stage.submit_all(prompts(1, n=2, prefix="c"))
    assert channel.depth() == 2
    assert stage.full  # no request, however small, fits now
    with pytest.raises(Overloaded):
        stage.submit_all(prompts(1, prefix="d"))


@pytest.mark.anyio
async def test_a_multi_prompt_request_is_admitted_whole_or_not_at_all() -> None:
    stage, channel = make_ingest(max_pending=8, capacity=4)
    stage.submit_all(prompts(2, prefix="a"))
    with pytest.raises(Overloaded):  # 3 prompts, room for 2 in the channel
        stage.submit_all(prompts(3, prefix="b"))
    assert channel.depth() == 2 and len(stage.services.mailboxes) == 2
    assert not stage.full
    stage.submit_all(prompts(2, prefix="c"))
    assert stage.full  # the channel has no room left


@pytest.mark.anyio
async def test_what_can_never_be_admitted_is_a_400_not_a_503() -> None:
    stage, channel = make_ingest(max_pending=8, capacity=4)
    error = refused(stage, prompts(5))  # more prompts than the channel holds
    assert (error.kind, error.param) == ("invalid_request", "prompt")
    error = refused(stage, prompts(1, n=9))  # more choices than max_pending
    assert (error.kind, error.param) == ("invalid_request", "n")
    error = refused(stage, prompts(3, n=3))
    assert (error.kind, error.param) == ("invalid_request", "prompt")
    error = refused(stage, prompts(1, n=30_000_000))  # out of range: checked first
    assert (error.kind, error.param) == ("invalid_request", "n")
    error = refused(stage, prompts(1, n=-(10**400)))
    assert (error.kind, error.param) == ("invalid_request", "n")
    assert channel.depth() == 0 and len(stage.services.mailboxes) == 0


@pytest.mark.anyio
async def test_a_huge_n_is_refused_at_once() -> None:
    stage, _ = make_ingest()
    with anyio.fail_after(0.1):
        refused(stage, prompts(1, n=30_000_000))


def test_the_offline_api_applies_the_same_limits(gpt2_tiny_dir: Path) -> None:
    """LLM(...) takes the limits as keywords; a request beyond one raises RequestFailed
    with the 400 the server would send, and the engine goes on serving."""
    llm = LLM(
        str(gpt2_tiny_dir), dtype="float32", max_model_len=128, kv_cache_memory=2**22, max_n=2
    )
    with pytest.raises(RequestFailed) as failed:
        llm.generate("hi", SamplingParams(n=10**12, max_tokens=1))
    assert failed.value.error.param == "n"
    with pytest.raises(RequestFailed) as failed:
        llm.generate("hi", SamplingParams(stop_token_ids=(2**63,), max_tokens=1))
    assert failed.value.error.param == "stop_token_ids"
    with pytest.raises(RequestFailed) as failed:
        llm.generate([1, 50257], SamplingParams(max_tokens=1))  # GPT-2's vocabulary: 50257
    assert failed.value.error.param == "prompt"
    (out,) = llm.generate("hi", SamplingParams(n=2, max_tokens=2, temperature=0))
    assert [len(o.token_ids) for o in out.outputs] == [2, 2]
