"""The schedule stage drops a request whose Abort overtook it (replicated upstream stages)."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
from prometheus_client import CollectorRegistry

from flowllm.config import EngineConfig
from flowllm.messages import SamplingParams, TokenizedRequest
from flowllm.metrics import EngineMetrics
from flowllm.scheduling.ledger import EARLY_ABORTS_KEPT
from flowllm.stages.schedule import Schedule, ScheduleParams


def make_stage() -> Schedule:
    services = SimpleNamespace(
        config=EngineConfig(),
        num_blocks=64,
        max_model_len=256,
        metrics=EngineMetrics(CollectorRegistry()),
    )
    return Schedule(ScheduleParams(), services)  # type: ignore[arg-type]


def request(request_id: str) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=request_id,
        prompt_token_ids=(1, 2, 3),
        params=SamplingParams(max_tokens=4),
        eos_token_ids=(0,),
        arrival_time=0.0,
    )


def test_an_abort_that_arrives_first_drops_its_request() -> None:
    stage = make_stage()

    async def scenario() -> None:
        stage._abort("early")
        await stage._add(request("early"), ctx=None)  # type: ignore[arg-type]
        await stage._add(request("other"), ctx=None)  # type: ignore[arg-type]

    anyio.run(scenario)
    assert stage.scheduler.get_sequence(0) is not None  # "other" got seq 0: "early" never ran
    assert stage.scheduler.get_sequence(0).request_id == "other"  # type: ignore[union-attr]
    assert stage.scheduler.get_sequence(1) is None


def test_abort_of_a_running_request_frees_it_and_is_not_remembered() -> None:
    stage = make_stage()
    anyio.run(stage._add, request("r"), None)
    stage._abort("r")
    assert not stage.scheduler.has_unfinished()
    assert not stage.scheduler.ledger.take_early_abort("r")


def test_remembered_early_aborts_are_bounded() -> None:
    stage = make_stage()
    for i in range(EARLY_ABORTS_KEPT + 10):
        stage._abort(f"gone-{i}")
    ledger = stage.scheduler.ledger
    assert not ledger.take_early_abort("gone-9")  # the oldest ten were forgotten
    assert all(ledger.take_early_abort(f"gone-{i}") for i in range(10, EARLY_ABORTS_KEPT + 10))
