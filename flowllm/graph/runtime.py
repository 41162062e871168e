"""Run a validated graph: one anyio task per stage replica, wired by channels.

Wiring. Every connected input port is one `Channel`. Each stage task gets its own receiver
clone per input port and its own sender clones per output port (one per channel the port
feeds), then the channels' originals are closed. So fan-in (several producers into one
port) is several sender clones of one channel, `replicas: N` is N receiver clones sharing
one inbox (each message goes to exactly one replica), and a stage's end closes exactly the
clones it held.

Lifecycle. The graph hands its wired tasks to a `Supervisor` (flowllm/graph/supervisor.py),
which runs them and owns what a failure does. A task runs `stage.run(ctx)`; when it
returns, its outboxes close (`StageContext.finish`). A channel ends for its consumers once
its last producer task has ended, so the end of input flows down the graph and the graph
finishes when every stage has returned.

Placement. A graph whose stages name processes runs one `Graph` per process, each built
with `process=` and a `Boundary`; which stages and channels it holds, and how they cross to
the other processes, is its `placement` (flowllm/graph/placement.py).

Graceful stop. `stop(timeout)` sets every context's `stop_requested` event and calls each
stage's `stop_intake()` (source stages stop taking work and return), waits up to `timeout`
for the graph to drain and finish; if it has not, it calls `fail_inflight` with a
`GraphStoppedError` on every stage (so no client waits forever) and cancels what is left.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import structlog
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry
from structlog.typing import FilteringBoundLogger

from flowllm.graph.channel import Channel
from flowllm.graph.metrics import GraphMetrics
from flowllm.graph.placement import Placement
from flowllm.graph.remote import Boundary
from flowllm.graph.spans import SpanRecorder, SpanSinks
from flowllm.graph.spec import GraphSpec, PortRef
from flowllm.graph.stage import CountsSequences, FailRequest, Outbox, Stage, StageContext
from flowllm.graph.supervisor import Child, StageFailure, Supervisor
from flowllm.graph.validator import ValidGraph, load_graph, validate_graph
from flowllm.logging_config import configure_logging


class GraphBuildError(RuntimeError):
    """A stage could not be constructed; the message names it."""


class GraphStoppedError(RuntimeError):
    """Given to `fail_inflight` when a graceful stop timed out with work still in flight."""


class Graph:
    """A running (or runnable) stage graph.

    `services` is handed to every stage constructor untouched (the engine passes its
    config, model, tokenizer, mailboxes and metrics). Metrics go to `registry` (a fresh
    `CollectorRegistry` by default), exposed as `graph.registry`. `spans=False` turns
    per-message spans off; `span_events` forces span log events on or off (default: on
    when the logger is enabled for DEBUG). `fail_request(error)` answers one request
    directly, for stages that fail a request and have no `errors` port. `graph.span_sinks`
    are the sinks handed every span (flowllm/graph/spans.py); `on_span_sinks` is told as the
    first comes or the last goes.
    """

    def __init__(
        self,
        graph: ValidGraph | GraphSpec | str | Path,
        services: object = None,
        *,
        registry: CollectorRegistry | None = None,
        logger: FilteringBoundLogger | None = None,
        spans: bool = True,
        span_events: bool | None = None,
        fail_inflight_timeout: float = 5.0,
        fail_request: FailRequest | None = None,
        process: str | None = None,
        boundary: Boundary | None = None,
        on_stop: Callable[[], Awaitable[None]] | None = None,
        on_span_sinks: Callable[[bool], None] | None = None,
    ) -> None:
        if isinstance(graph, (str, Path)):
            graph = load_graph(graph)
        elif isinstance(graph, GraphSpec):
            graph = validate_graph(graph)
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
        self._fail_request = fail_request
        self.span_sinks = SpanSinks(on_span_sinks)
        self._started = False
        self._finished = False
        self._stopping = False
        self._scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._stop_requested: anyio.Event | None = None

        # Run once a graceful stop has stopped intake, before the graph drains: a front
        # waits there for its requests, then ends what its core feeds it.
        self._on_stop = on_stop
        self.placement = Placement(graph, process, boundary)
        self.channels = self.placement.channels()
        for channel in self.channels.values():
            self.metrics.watch_channel(channel)

        self._children: list[Child] = []
        for bound in graph.stages.values():
            if not self.placement.runs_here(bound.name):
                continue
            for replica in range(bound.spec.replicas):
                stage = self._build(bound.name)
                self._children.append(Child(bound.name, replica, stage, bound.supervision))
            if hasattr(bound.cls, "live_sequences"):
                self.metrics.live_sequences.labels(bound.name).set_function(
                    functools.partial(self._live_sequences, bound.name)
                )
        self.supervisor = Supervisor(
            self._children,
            rebuild=self._build,
            discard=self._discard_internal,
            log=self.log,
            metrics=self.metrics,
            fail_request=fail_request,
            fail_inflight_timeout=fail_inflight_timeout,
        )

    def _live_sequences(self, name: str) -> int:
        """The live sequences of a stage's replicas (its current instances, after restarts)."""
        replicas = self.replicas(name)
        return sum(s.live_sequences() for s in replicas if isinstance(s, CountsSequences))

    def _build(self, name: str) -> Stage:
        bound = self.spec.stages[name]
        try:
            return bound.cls(bound.params, self.services)
        except Exception as exc:
            raise GraphBuildError(
                f"stage {bound.name!r} ({bound.cls.__name__}) failed to build: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    # -- what the graph's owner uses ------------------------------------------------------

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def healthy(self) -> bool:
        """The supervisor's verdict, read by `/health` (flowllm/graph/supervisor.py)."""
        return self.supervisor.healthy

    @property
    def failure(self) -> StageFailure | None:
        """The failure that escalated and stopped the graph, if one did."""
        return self.supervisor.failure

    @property
    def failed(self) -> bool:
        """A failure escalated: the graph stopped; its owner should exit non-zero."""
        return self.failure is not None

    async def wait_finished(self) -> None:
        """Return once the graph has finished (stopped, drained or failed)."""
        if self._done is not None:
            await self._done.wait()

    @property
    def running(self) -> bool:
        return self.supervisor.running

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def stages_here(self) -> tuple[str, ...]:
        """The names of the stages this process runs (all of them in an unplaced run)."""
        return tuple(dict.fromkeys(child.name for child in self._children))

    def stage(self, name: str) -> Stage:
        """The stage object named `name` (its first replica), e.g. to call `submit()`."""
        return self.replicas(name)[0]

    def replicas(self, name: str) -> list[Stage]:
        """The stage objects named `name`, one per replica (current after restarts)."""
        replicas = [child.stage for child in self._children if child.name == name]
        if not replicas:
            raise KeyError(f"graph {self.name!r} has no stage {name!r}")
        return replicas

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

    async def run(self, *, task_status: TaskStatus[Graph] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every stage until all have returned (or the graph failed or was stopped)."""
        if self._started:
            raise RuntimeError(f"graph {self.name!r} has already run; build a new Graph")
        self._started = True
        self._done = anyio.Event()
        self._stop_requested = anyio.Event()
        self._wire()
        self.log.info("graph starting", stages=len(self.stages_here), tasks=len(self._children))
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                await tg.start(self.supervisor.run)
                task_status.started(self)
        finally:
            self._finished = True
            for child in self._children:
                if child.ctx is not None:
                    child.ctx.close()
                child.stage.bind(None)
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
        on_stop = None
        if not self._stopping:
            on_stop = self._on_stop
            self._stopping = True
            self.log.info("graph stopping", timeout_s=timeout)
            self._stop_requested.set()
            for child in self._children:
                try:
                    await child.stage.stop_intake()
                except Exception as exc:
                    self.log.warning("stop_intake raised", stage=child.name, exc_info=exc)
        with anyio.move_on_after(timeout):
            if on_stop is not None:
                await on_stop()
            await self._done.wait()
            return self.failure is None
        self.log.warning("graph did not drain in time; cancelling", timeout_s=timeout)
        if self.failure is None:
            # Answer what is still in flight (deliver sends each open request an error)
            # instead of leaving its clients waiting on a graph that no longer runs.
            await self.supervisor.fail_inflight(
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
        """Give every child its channel clones, then close the originals."""
        if self._stop_requested is None:
            raise RuntimeError("_wire() runs inside run()")
        spec = self.spec
        for child in self._children:
            bound = spec.stages[child.name]
            inboxes = {
                port: channel.receiver()
                for port in bound.cls.inputs
                # an optional port may be unwired; an input here is a local channel
                if isinstance(channel := self.channels.get(f"{child.name}.{port}"), Channel)
            }
            outboxes = {}
            for port in bound.cls.outputs:
                targets = spec.fanout.get(PortRef(child.name, port))
                if targets:  # an optional port may be unwired
                    outboxes[port] = Outbox(port, [self.channels[t].sender() for t in targets])
            log = self.log.bind(stage=child.name, replica=child.replica)
            child.ctx = StageContext(
                name=child.name,
                replica=child.replica,
                inboxes=inboxes,
                outboxes=outboxes,
                log=log,
                fail_request=self._fail_request,
                spans=SpanRecorder(
                    child.name,
                    log,
                    self.metrics,
                    enabled=self._spans,
                    events=self._span_events,
                    sinks=self.span_sinks,  # shared: sinks may come and go
                ),
                stop_requested=self._stop_requested,
            )
            child.stage.bind(child.ctx)
        self.placement.feed_from_afar(self.channels)
        for channel in self.channels.values():
            channel.close()

    def _discard_internal(self, members: Collection[str]) -> None:
        """Drop what waits on the channels only `members` feed: a restarting group's
        messages of the failed run (one replica's receiver drains the shared channel)."""
        for child in self._children:
            if child.name not in members or child.replica != 0 or child.ctx is None:
                continue
            for port in child.ctx.input_ports:
                channel = self.spec.channels[f"{child.name}.{port}"]
                if not all(p.stage in members for p in channel.producers):
                    continue
                inbox, dropped = child.ctx.inbox(port), 0
                while True:
                    try:
                        inbox.receive_nowait()
                    except (anyio.WouldBlock, anyio.EndOfStream):
                        break
                    dropped += 1
                self.log.debug("discarded on restart", channel=channel.name, n=dropped)
