"""The ingress's engine client over real engine replicas without Ray: each replica an
engine core on TCP in this process, found through a scripted Serve handle. Requests reach
one replica's front and come back; admission refuses as a single server does; an abort
reaches the replica's core; a replica that dies fails its requests in flight with
`replica_failed` and leaves routing, and its replacement, found at its new address,
serves again."""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from server_process import TINY_FLAGS, small_pending_graph

from flowllm.cli import build_parser
from flowllm.engine.args import config_from_args
from flowllm.engine.async_engine import DEFAULT_GRAPH
from flowllm.graph.validator import load_graph
from flowllm.mailbox import Mailbox, Overloaded, RequestFailed
from flowllm.messages import GenerateRequest, SamplingParams
from flowllm.models.tokenizer import load_tokenizer, tokenizer_source
from flowllm.scale_out.replica import EngineReplica
from flowllm.scale_out.routed_engine import RoutedEngine

pytestmark = pytest.mark.anyio
_ids = itertools.count()
LONG = SamplingParams(max_tokens=480, ignore_eos=True)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Method:
    def __init__(self, call: Callable[..., Any]) -> None:
        self.remote = call


class Handle:
    """A replica's Serve handle: `describe` answers while `replica` runs (a dead actor's
    calls fail until Ray has started a new one)."""

    def __init__(self, replica: EngineReplica) -> None:
        self.replica: EngineReplica | None = replica
        self.described = 0

        async def describe() -> dict[str, Any]:
            self.described += 1
            if self.replica is None:
                raise RuntimeError("the actor died")
            return self.replica.describe()

        self.describe = Method(describe)


async def start_replica(args: Any, token: str) -> EngineReplica:
    replica = EngineReplica.__new__(EngineReplica)
    await replica.__init__(args, 1, token)  # type: ignore[misc]
    return replica


def kill(replica: EngineReplica) -> None:
    """The replica's process dies: its core ends at once, its connections with it."""
    replica._runner.cancel()


@asynccontextmanager
async def routed(
    gpt2_tiny_dir: Path, replicas: int, graph_file: Path = DEFAULT_GRAPH
) -> AsyncIterator[tuple[RoutedEngine, list[Handle], Any]]:
    argv = ["serve", str(gpt2_tiny_dir), *TINY_FLAGS, "--shutdown-timeout", "5"]
    args = build_parser().parse_args([*argv, "--graph", str(graph_file)])
    config = config_from_args(args)
    handles = [Handle(await start_replica(args, f"token-{i}")) for i in range(replicas)]
    async with AsyncExitStack() as stack:
        for handle in handles:
            stack.push_async_callback(_stop, handle)
        async with RoutedEngine.start(
            [(f"engine-{i}", h, f"token-{i}") for i, h in enumerate(handles)],
            config=config,
            graph=load_graph(graph_file),
            routing="round_robin",
            imbalance_bound=8,
            tokenizer=load_tokenizer(*tokenizer_source(config)),
            stop_timeout=5,
        ) as engine:
            yield engine, handles, args


async def _stop(handle: Handle) -> None:
    if handle.replica is not None and not handle.replica._runner.done():
        await handle.replica.__del__()


def request(engine: RoutedEngine, params: SamplingParams | None = None) -> GenerateRequest:
    return GenerateRequest(
        request_id=f"r{next(_ids)}",
        model=engine.model_name,
        params=params or SamplingParams(max_tokens=4),
        arrival_time=time.monotonic(),
        prompt="Once upon a time",
    )


async def finished(box: Mailbox) -> str | None:
    """The finish reason of the box's one choice."""
    reason = None
    async for chunk in box:
        reason = chunk.finish_reason or reason
    return reason


def core_tokens(handle: Handle) -> float:
    assert handle.replica is not None
    registry = handle.replica._core.services.registry
    return registry.get_sample_value("flowllm:generation_tokens_total") or 0.0


async def test_requests_go_round_the_replicas_and_come_back(gpt2_tiny_dir: Path) -> None:
    async with routed(gpt2_tiny_dir, 2) as (engine, handles, _):
        assert engine.healthy and engine.health_detail == ""
        boxes = [engine.submit(request(engine)) for _ in range(4)]
        assert [link.in_flight for link in engine.links] == [2, 2]
        assert [await finished(box) for box in boxes] == ["length"] * 4
        assert [link.in_flight for link in engine.links] == [0, 0]
        assert [core_tokens(h) for h in handles] == [8.0, 8.0]  # 2 x 4 tokens on each


async def test_admission_refuses_as_a_single_server(gpt2_tiny_dir: Path, tmp_path: Path) -> None:
    graph = small_pending_graph(tmp_path / "one-pending.yaml", 1)
    async with routed(gpt2_tiny_dir, 1, graph) as (engine, _, _):
        assert not engine.full
        box = engine.submit(request(engine))
        assert engine.full  # the API refuses at the door
        with pytest.raises(Overloaded):  # the front's ingest: 503 with Retry-After
            engine.submit(request(engine))
        with pytest.raises(RequestFailed) as never:  # more choices than it ever admits: 400
            engine.submit(request(engine, SamplingParams(n=2)))
        assert never.value.error.kind == "invalid_request"
        assert await finished(box) == "length"


async def test_an_abort_reaches_the_replicas_core(gpt2_tiny_dir: Path) -> None:
    async with routed(gpt2_tiny_dir, 1) as (engine, handles, _):
        sent = request(engine, LONG)
        box = engine.submit(sent)
        await box.__anext__()
        engine.abort(sent.request_id)
        core = handles[0].replica._core  # type: ignore[union-attr]
        with anyio.fail_after(10):
            while core.busy:
                await anyio.sleep(0.01)
        assert core_tokens(handles[0]) < LONG.max_tokens / 2
        engine.abort(sent.request_id)  # finished by now: ignored


async def test_a_dead_replica_fails_its_requests_and_leaves_routing(gpt2_tiny_dir: Path) -> None:
    async with routed(gpt2_tiny_dir, 2) as (engine, handles, args):
        doomed, survivor = engine.submit(request(engine, LONG)), engine.submit(request(engine))
        await doomed.__anext__()
        dead = handles[0].replica
        assert dead is not None
        handles[0].replica = None
        kill(dead)
        with pytest.raises(RequestFailed) as failed:
            async for _ in doomed:
                pass
        error = failed.value.error
        assert (error.kind, error.code, error.request_id) == (
            "unavailable", "replica_failed", doomed.request_id,
        )  # fmt: skip
        assert "engine-0" in error.message
        assert await finished(survivor) == "length"
        assert engine.healthy and engine.health_detail == (
            "degraded: 1 of 2 replicas serving; down: engine-0"
        )
        before = core_tokens(handles[1])
        boxes = [engine.submit(request(engine)) for _ in range(3)]  # all to the one serving
        assert [await finished(box) for box in boxes] == ["length"] * 3
        assert core_tokens(handles[1]) - before == 3 * 4

        # Ray starts a replacement: a new core on a new port, found by asking again.
        asked = handles[0].described
        handles[0].replica = await start_replica(args, "token-0")
        with anyio.fail_after(10):
            while engine.health_detail:
                await anyio.sleep(0.01)
        assert handles[0].described > asked
        assert engine.links[0].restarted()
        boxes = [engine.submit(request(engine)) for _ in range(2)]  # round robin again
        assert [await finished(box) for box in boxes] == ["length"] * 2
        assert core_tokens(handles[0]) == 4.0
