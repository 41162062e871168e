"""Run a validated graph: one anyio task per stage replica, all in one task group.

Wiring. Every connected input port is one `Channel`. Each stage task gets its own receiver
clone per input port and its own sender clones per output port (one per channel the port
feeds), then the channels' originals are closed. So fan-in (several producers into one
port) is several sender clones of one channel, `replicas: N` is N receiver clones sharing
one inbox (each message goes to exactly one replica), and a stage's end closes exactly the
clones it held.

Lifecycle. A stage task runs `stage.run(ctx)`; when it returns, its outboxes close. A
channel ends for its consumers once its last producer task has ended, so the end of input
flows down the graph and the graph finishes when every stage has returned. Inputs still
open when a stage returns (a stage on a cycle decides itself when it is done) are drained
and their late messages dropped, so their producers neither fail nor block.

Supervision. If a stage raises, the runtime logs the stage and traceback, counts it in
`flowllm:stage_errors_total`, marks the graph unhealthy, calls `fail_inflight(error)` on
every stage (so `format` can answer open requests with a 500), then cancels the task
group. `run()` returns; the failure stays on `graph.failure`.

Graceful stop. `stop(timeout)` sets every context's `stop_requested` event and calls each
stage's `stop_intake()` (source stages stop taking work and return), waits up to `timeout`
for the graph to drain and finish; if it has not, it calls `fail_inflight` with a
`GraphStoppedError` on every stage (so no client waits forever) and cancels what is left.
"""

from __future__ import annotations

import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry

from flowllm.graph.channel import Channel
from flowllm.graph.spans import GraphMetrics, SpanRecorder, SpanSink, configure_logging
from flowllm.graph.spec import GraphSpec, PortRef, ValidGraph, load_graph
from flowllm.stages.base import CLOSED, Outbox, Stage, StageContext


class GraphBuildError(RuntimeError):
    """A stage could not be constructed; the message names it."""


class GraphStoppedError(RuntimeError):
    """Given to `fail_inflight` when a graceful stop timed out with work still in flight."""


@dataclass(frozen=True)
class StageFailure:
    """The first stage error that brought the graph down."""

    stage: str
    replica: int
    error: BaseException
    traceback: str


@dataclass
class _Task:
    name: str
    replica: int
    stage: Stage
    ctx: StageContext | None = None


class Graph:
    """A running (or runnable) stage graph.

    `services` is handed to every stage constructor untouched (the engine passes its
    config, model, tokenizer, mailboxes and metrics). Metrics go to `registry` (a fresh
    `CollectorRegistry` by default), exposed as `graph.registry`. `spans=False` turns
    per-message spans off; `span_events` forces span log events on or off (default: on
    when the logger is enabled for DEBUG).
    """

    def __init__(
        self,
        graph: ValidGraph | GraphSpec | str | Path,
        services: Any = None,
        *,
        registry: CollectorRegistry | None = None,
        logger: Any = None,
        spans: bool = True,
        span_events: bool | None = None,
        fail_inflight_timeout: float = 5.0,
    ) -> None:
        if isinstance(graph, (str, Path)):
            graph = load_graph(graph)
        elif isinstance(graph, GraphSpec):
            graph = graph.validate()
        self.spec = graph
        self.services = services
        self.metrics = GraphMetrics(registry)
        self.registry = self.metrics.registry
        if logger is None:
            configure_logging()
            logger = structlog.get_logger("flowllm.graph")
        self.log = logger.bind(graph=graph.name)
        self._spans = spans
        self._span_events = span_events
        self._fail_inflight_timeout = fail_inflight_timeout
        self._span_sinks: list[SpanSink] = []
        self.failure: StageFailure | None = None
        self._running = False
        self._started = False
        self._finished = False
        self._stopping = False
        self._scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._stop_requested: anyio.Event | None = None
        self.metrics.graph_healthy.set_function(lambda: 1.0 if self.healthy else 0.0)

        self.channels: dict[str, Channel[Any]] = {}
        for spec in graph.channels.values():
            channel: Channel[Any] = Channel(spec.name, spec.message_type, spec.capacity)
            self.channels[spec.name] = channel
            self.metrics.watch_channel(channel)

        self._replicas: dict[str, list[Stage]] = {}
        self._tasks: list[_Task] = []
        for bound in graph.stages.values():
            instances = []
            for replica in range(bound.spec.replicas):
                try:
                    stage = bound.cls(bound.params, services)
                except Exception as exc:
                    raise GraphBuildError(
                        f"stage {bound.name!r} ({bound.cls.__name__}) failed to build: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                instances.append(stage)
                self._tasks.append(_Task(bound.name, replica, stage))
            self._replicas[bound.name] = instances

    # -- what the graph's owner uses ------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def healthy(self) -> bool:
        """True while the graph runs and no stage has failed (read by `/health`)."""
        return self._running and self.failure is None

    @property
    def running(self) -> bool:
        return self._running

    @property
    def finished(self) -> bool:
        return self._finished

    def stage(self, name: str) -> Stage:
        """The stage object named `name` (its first replica), e.g. to call `submit()`."""
        return self.replicas(name)[0]

    def replicas(self, name: str) -> list[Stage]:
        try:
            return list(self._replicas[name])
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no stage {name!r}") from None

    def add_span_sink(self, sink: SpanSink) -> None:
        """Also hand every span to `sink` (a trace recorder); call before `run()`."""
        if self._started:
            raise RuntimeError("add span sinks before the graph runs")
        self._span_sinks.append(sink)

    @asynccontextmanager
    async def serve(self, stop_timeout: float = 10.0) -> AsyncIterator[Graph]:
        """Run the graph in the background for the body; on exit, stop it gracefully.

        Once the body starts, every stage's outboxes exist, so the owner can call stage
        methods that emit. (A Litestar lifespan is this context manager.)
        """
        error: Exception | None = None
        async with anyio.create_task_group() as tg:
            await tg.start(self.run)
            try:
                yield self
            except Exception as exc:  # re-raised below as itself, not in an ExceptionGroup
                error = exc
            finally:
                with anyio.CancelScope(shield=True):
                    await self.stop(stop_timeout)
        if error is not None:
            raise error

    async def run(self, *, task_status: TaskStatus[Any] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every stage until all have returned (or the graph failed or was stopped)."""
        if self._started:
            raise RuntimeError(f"graph {self.name!r} has already run; build a new Graph")
        self._started = True
        self._done = anyio.Event()
        self._stop_requested = anyio.Event()
        self._wire()
        self.log.info("graph starting", stages=len(self._replicas), tasks=len(self._tasks))
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                for task in self._tasks:
                    tg.start_soon(self._run_stage, task, name=f"{task.name}[{task.replica}]")
                self._running = True
                task_status.started(self)
        finally:
            self._running = False
            self._finished = True
            for task in self._tasks:
                if task.ctx is not None:
                    task.ctx.close()
                task.stage.bind(None)
            self._done.set()
            if self.failure is not None:
                self.log.error("graph stopped after a failure", stage=self.failure.stage)
            else:
                self.log.info("graph finished")

    async def stop(self, timeout: float = 10.0) -> bool:
        """Stop intake, drain for up to `timeout` seconds, then cancel; True if it drained."""
        if not self._started or self._done is None or self._stop_requested is None:
            return True
        if self._finished:
            return self.failure is None
        if not self._stopping:
            self._stopping = True
            self.log.info("graph stopping", timeout_s=timeout)
            self._stop_requested.set()
            for task in self._tasks:
                try:
                    await task.stage.stop_intake()
                except Exception as exc:
                    self.log.warning("stop_intake raised", stage=task.name, exc_info=exc)
        with anyio.move_on_after(timeout):
            await self._done.wait()
            return self.failure is None
        self.log.warning("graph did not drain in time; cancelling", timeout_s=timeout)
        if self.failure is None:
            # Answer what is still in flight (format sends each open request an error)
            # instead of leaving its clients waiting on a graph that no longer runs.
            await self._fail_all_inflight(
                GraphStoppedError(
                    f"graph {self.name!r} stopped before this work finished "
                    f"(drain timeout {timeout} s)"
                )
            )
        if self._scope is not None:
            self._scope.cancel()
        await self._done.wait()
        return False

    # -- internals ------------------------------------------------------------------------

    def _wire(self) -> None:
        """Give every task its channel clones, then close the originals."""
        if self._stop_requested is None:
            raise RuntimeError("_wire() runs inside run()")
        spec = self.spec
        for task in self._tasks:
            bound = spec.stages[task.name]
            inboxes = {
                port: self.channels[f"{task.name}.{port}"].receiver() for port in bound.cls.inputs
            }
            outboxes = {}
            for port in bound.cls.outputs:
                targets = spec.fanout[PortRef(task.name, port)]
                outboxes[port] = Outbox(port, [self.channels[t].sender() for t in targets])
            log = self.log.bind(stage=task.name, replica=task.replica)
            task.ctx = StageContext(
                name=task.name,
                replica=task.replica,
                inboxes=inboxes,
                outboxes=outboxes,
                log=log,
                spans=SpanRecorder(
                    task.name,
                    log,
                    self.metrics,
                    enabled=self._spans,
                    events=self._span_events,
                    sinks=tuple(self._span_sinks),
                ),
                stop_requested=self._stop_requested,
            )
            task.stage.bind(task.ctx)
        for channel in self.channels.values():
            channel.close()

    async def _run_stage(self, task: _Task) -> None:
        ctx = task.ctx
        if ctx is None:
            raise RuntimeError(f"stage {task.name!r} was not wired")
        try:
            await task.stage.run(ctx)
        except Exception as exc:
            await self._on_failure(task, exc)
        else:
            ctx.close_outputs()
            late = await self._drain_late(ctx)
            ctx.log.debug("stage finished", late_messages_dropped=late)
        finally:
            ctx.close()

    @staticmethod
    async def _drain_late(ctx: StageContext) -> int:
        """Discard what still arrives on a finished stage's open inputs until they close.

        A stage on a cycle ends by its own decision (e.g. schedule, once its request input
        has closed and nothing is in flight) while other inputs may still be open; a late
        message there (a stop-string Finish racing the last step) is no longer needed.
        Draining instead of closing keeps its producers from failing or blocking.
        """
        dropped = 0
        while True:
            try:
                _port, message = await ctx.receive_any()
            except anyio.EndOfStream:
                return dropped
            if message is not CLOSED:
                dropped += 1

    async def _on_failure(self, task: _Task, error: Exception) -> None:
        self.metrics.stage_errors.labels(task.name).inc()
        if self.failure is not None:
            # The graph is already going down; later errors are usually its consequences.
            ctx_log = self.log.bind(stage=task.name, replica=task.replica)
            ctx_log.warning("stage raised while the graph was failing", exc_info=error)
            return
        self.failure = StageFailure(
            task.name, task.replica, error, "".join(traceback.format_exception(error))
        )
        self.log.error(
            "stage failed; failing in-flight work and shutting the graph down",
            stage=task.name,
            replica=task.replica,
            exc_info=error,
        )
        await self._fail_all_inflight(error)
        if self._scope is not None:
            self._scope.cancel()

    async def _fail_all_inflight(self, error: BaseException) -> None:
        """Call every stage's `fail_inflight(error)`, shielded and bounded in time."""
        with anyio.move_on_after(self._fail_inflight_timeout, shield=True) as scope:
            for task in self._tasks:
                try:
                    await task.stage.fail_inflight(error)
                except Exception as exc:
                    self.log.warning("fail_inflight raised", stage=task.name, exc_info=exc)
        if scope.cancelled_caught:
            self.log.warning("fail_inflight timed out", timeout_s=self._fail_inflight_timeout)
