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
with `process=` (its own stages only) and a `Boundary` (flowllm/graph/remote.py): a
channel whose consumer runs elsewhere is a `RemoteChannel` here, and one fed from
elsewhere is a local channel the boundary's peers also send into. Without `process=`
the whole graph runs here, placed or not.

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
from typing import Any

import anyio
import structlog
from anyio.abc import TaskStatus
from prometheus_client import CollectorRegistry
from structlog.typing import FilteringBoundLogger

from flowllm.graph.channel import Channel
from flowllm.graph.metrics import GraphMetrics
from flowllm.graph.remote import Boundary, RemoteChannel
from flowllm.graph.spans import SpanRecorder, SpanSink
from flowllm.graph.spec import GraphSpec, PortRef
from flowllm.graph.stage import CountsSequences, FailRequest, Outbox, Stage, StageContext
from flowllm.graph.supervisor import Child, StageFailure, Supervisor
from flowllm.graph.validator import ChannelSpec, ValidGraph, load_graph
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
    directly, for stages that fail a request and have no `errors` port.
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
        self._fail_request = fail_request
        self._span_sinks: list[SpanSink] = []
        self._started = False
        self._finished = False
        self._stopping = False
        self._scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._stop_requested: anyio.Event | None = None

        self.process = process if graph.placement else None
        # Run once a graceful stop has stopped intake, before the graph drains: a front
        # waits there for its requests, then ends what its core feeds it.
        self._on_stop = on_stop
        # Told whether the graph has span sinks, as the first comes or the last goes: a
        # front asks its core for the core's spans only while they are read.
        self._on_span_sinks = on_span_sinks
        self._boundary = boundary
        self.channels: dict[str, Channel[Any] | RemoteChannel] = {}
        self._fed_from_afar: list[tuple[ChannelSpec, Channel[Any]]] = []
        for spec in graph.channels.values():
            channel: Channel[Any] | RemoteChannel
            if self.runs_here(spec.dst.stage):
                channel = Channel(spec.name, spec.message_type, spec.capacity)
                if not all(self.runs_here(p.stage) for p in spec.producers):
                    self._fed_from_afar.append((spec, channel))
            elif any(self.runs_here(p.stage) for p in spec.producers):
                channel = self._require_boundary(spec).outbound(
                    spec, graph.placement[spec.dst.stage]
                )
            else:
                continue
            self.channels[spec.name] = channel
            self.metrics.watch_channel(channel)

        self._children: list[Child] = []
        for bound in graph.stages.values():
            if not self.runs_here(bound.name):
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

    def runs_here(self, stage: str) -> bool:
        """Whether `stage` runs in this process (every stage does in an unplaced run)."""
        return self.process is None or self.spec.placement[stage] == self.process

    def _require_boundary(self, spec: ChannelSpec) -> Boundary:
        if self._boundary is None:
            raise GraphBuildError(
                f"channel {spec.name!r} crosses processes, and process {self.process!r} was "
                "given no boundary to carry it"
            )
        return self._boundary

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

    def add_span_sink(self, sink: SpanSink) -> None:
        """Also hand every span to `sink` (a trace recorder, a page's request timelines).

        Added before `run()`, it sees every span; added later, the spans from then on.
        """
        self._span_sinks.append(sink)
        if len(self._span_sinks) == 1 and self._on_span_sinks is not None:
            self._on_span_sinks(True)

    def remove_span_sink(self, sink: SpanSink) -> None:
        """Stop handing spans to `sink` (an observer that left): no cost remains."""
        self._span_sinks.remove(sink)
        if not self._span_sinks and self._on_span_sinks is not None:
            self._on_span_sinks(False)

    @property
    def has_span_sinks(self) -> bool:
        return bool(self._span_sinks)

    def relay_span(
        self, stage: str, message: object, started: float, duration: float, queue_wait: float
    ) -> None:
        """Hand this graph's sinks a span its other process recorded (clocks agree: both
        read the machine's monotonic clock)."""
        for sink in self._span_sinks:
            sink(stage, message, started, duration, queue_wait)

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
                    sinks=self._span_sinks,  # shared: sinks may come and go
                ),
                stop_requested=self._stop_requested,
            )
            child.stage.bind(child.ctx)
        for fed, local in self._fed_from_afar:
            far = {self.spec.placement[p.stage] for p in fed.producers} - {self.process}
            self._require_boundary(fed).inbound(fed, local, sorted(far))
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
