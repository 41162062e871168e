"""An engine replica: a whole flowllm graph in a Ray Serve replica, called by the ingress.

The graph runs in a task of the replica's event loop for the replica's whole life (its
async context must be entered and left in one task). `generate` streams one API request's
events; when the caller cancels the call (the client left, or the ingress aborted it), the
generator is cancelled here and aborts every sub-request still running, so the blocks are
freed in this replica. Serve calls `check_health`: a graph that failed for good raises,
and Serve replaces the replica.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from prometheus_client import generate_latest

from flowllm.engine.async_engine import AsyncEngine
from flowllm.mailbox import Mailbox, Overloaded, RequestFailed
from flowllm.scale_out.wire import (
    ChunkEvent,
    ErrorEvent,
    Event,
    Refused,
    decode_submission,
    encode_event,
)
from flowllm.stages.services import EngineServices

if TYPE_CHECKING:
    from flowllm.graph.validator import ValidGraph


class EngineReplica:
    """One data-parallel engine: `args` are `flowllm serve`'s, `threads` torch's threads."""

    async def __init__(self, args: argparse.Namespace, threads: int) -> None:  # type: ignore[misc]
        import torch

        from flowllm.engine.args import config_from_args
        from flowllm.engine.async_engine import DEFAULT_GRAPH
        from flowllm.engine.loading import build_services
        from flowllm.graph.validator import load_graph
        from flowllm.logging_config import configure_logging

        configure_logging(fmt=args.log_format, level=args.log_level, force=True)
        torch.set_num_threads(threads)
        graph = load_graph(args.graph or DEFAULT_GRAPH)
        services = await anyio.to_thread.run_sync(build_services, config_from_args(args))
        self._services = services
        self._stop = anyio.Event()
        # request id -> the task forwarding its mailbox, while its generate call runs
        self._forwarders: dict[str, asyncio.Task[None]] = {}
        started: asyncio.Future[AsyncEngine] = asyncio.get_running_loop().create_future()
        self._runner = asyncio.create_task(
            self._run(graph, services, args.shutdown_timeout, started)
        )
        self._engine = await started

    async def _run(
        self,
        graph: ValidGraph,
        services: EngineServices,
        stop_timeout: float,
        started: asyncio.Future[AsyncEngine],
    ) -> None:
        try:
            async with AsyncEngine.start(
                graph=graph, services=services, stop_timeout=stop_timeout
            ) as engine:
                started.set_result(engine)
                await self._stop.wait()
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise

    def describe(self) -> dict[str, Any]:
        """What the ingress needs to know once: names, context length, cache geometry."""
        return {
            "model_name": self._engine.model_name,
            "max_model_len": self._engine.max_model_len,
            "num_blocks": self._services.num_blocks,
            "block_size": self._services.config.cache.block_size,
        }

    def probe(self) -> dict[str, Any]:
        """Health, process id and the metrics registry as Prometheus text, for the ingress."""
        engine = self._engine
        return {
            "healthy": engine.healthy and engine.accepting,
            "pid": os.getpid(),
            "metrics": generate_latest(engine.metrics_registry),
        }

    def check_health(self) -> None:
        """Serve's health check: a graph that failed past its supervision is replaced."""
        if self._runner.done() or not self._engine.accepting:
            raise RuntimeError("the engine replica's graph has stopped")

    async def generate(self, payload: bytes) -> AsyncIterator[bytes]:
        """Run one API request's sub-requests; stream their chunks and errors as events."""
        requests = decode_submission(payload)
        engine = self._engine
        try:
            boxes = engine.submit_all(requests)
        except Overloaded as exc:
            yield encode_event(Refused(retry_after=exc.retry_after))
            return
        except RequestFailed as failed:
            yield encode_event(Refused(error=failed.error))
            return
        events: asyncio.Queue[Event | None] = asyncio.Queue()
        for box in boxes:
            self._forwarders[box.request_id] = asyncio.create_task(self._forward(box, events))
        remaining = len(boxes)
        try:
            while remaining:
                event = await events.get()
                if event is None:
                    remaining -= 1
                else:
                    yield encode_event(event)
        finally:
            for box in boxes:
                task = self._forwarders.pop(box.request_id, None)
                if task is not None:
                    task.cancel()
                if not box.done:
                    engine.abort(box.request_id)

    @staticmethod
    async def _forward(box: Mailbox, events: asyncio.Queue[Event | None]) -> None:
        try:
            async for chunk in box:
                events.put_nowait(ChunkEvent(chunk))
        except RequestFailed as failed:
            events.put_nowait(ErrorEvent(failed.error))
        finally:
            events.put_nowait(None)  # this sub-request is over, however it ended

    def abort(self, request_id: str) -> None:
        """Stop one sub-request of a running `generate` call (its blocks are freed)."""
        task = self._forwarders.pop(request_id, None)
        if task is not None:
            self._engine.abort(request_id)
            task.cancel()

    async def __del__(self) -> None:
        """Serve stops the replica: drain the graph (up to --shutdown-timeout)."""
        self._stop.set()
        await asyncio.shield(self._runner)
