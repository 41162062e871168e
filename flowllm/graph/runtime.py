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

Supervision (flowllm/graph/supervision.py). The stages of one supervision group run in a
task group of their own, each member in a cancel scope the watchdog can cancel. A member
whose `run` raises (or outlives its `timeout_s` on one message) is handled by its
group's `on_error`: `fail_request` answers the requests of the message it was handling
and runs the stage on; `restart` cancels the group, discards the messages on channels
internal to it, builds every member anew from its class (`restart_from` carries over
what survives) and runs them on the same channels; `escalate`, or a group past its
restart intensity, fails all in-flight work, marks the graph failed and cancels it (the
failure stays on `graph.failure`). `/health` reads `healthy`: false while a group
restarts, a stage is overdue, or the graph has failed.

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
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
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
from flowllm.graph.stage import (
    CLOSED,
    CountsSequences,
    FailRequest,
    Outbox,
    RequestInputError,
    Stage,
    StageContext,
)
from flowllm.graph.supervision import RestartIntensity
from flowllm.graph.validator import ChannelSpec, ValidGraph, load_graph
from flowllm.logging_config import configure_logging
from flowllm.messages import ErrorKind, RequestError


class GraphBuildError(RuntimeError):
    """A stage could not be constructed; the message names it."""


class GraphStoppedError(RuntimeError):
    """Given to `fail_inflight` when a graceful stop timed out with work still in flight."""


class StageTimeout(RuntimeError):
    """A stage handled one message for longer than its `timeout_s` (the watchdog's verdict)."""


@dataclass(frozen=True)
class StageFailure:
    """The first stage error that brought the graph down."""

    stage: str
    replica: int
    error: BaseException
    traceback: str


@dataclass(eq=False)
class _Task:
    name: str
    replica: int
    stage: Stage
    timeout_s: float | None = None
    ctx: StageContext | None = None
    scope: anyio.CancelScope | None = None  # the running member's, for the watchdog
    overdue: bool = False  # past its timeout on a message; unhealthy until seen idle
    timed_out: bool = False  # the watchdog cancelled it
    finished: bool = False  # its run returned: the end of its input reached it


@dataclass
class _Group:
    """Stages supervised together: one policy, one restart intensity."""

    name: str
    on_error: str
    intensity: RestartIntensity
    tasks: list[_Task] = field(default_factory=list)
    scope: anyio.CancelScope | None = None
    restart_cause: BaseException | None = None  # set when a member asks for a restart
    restarting: bool = False


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
        self._fail_inflight_timeout = fail_inflight_timeout
        self._fail_request = fail_request
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

        self._replicas: dict[str, list[Stage]] = {}
        self._tasks: list[_Task] = []
        self._groups: dict[str, _Group] = {}
        for bound in graph.stages.values():
            if not self.runs_here(bound.name):
                continue
            plan = bound.supervision
            group = self._groups.get(plan.group)
            if group is None:
                intensity = RestartIntensity(plan.settings.max_restarts, plan.settings.within_s)
                group = self._groups[plan.group] = _Group(plan.group, plan.on_error, intensity)
            instances = []
            for replica in range(bound.spec.replicas):
                stage = self._build(bound.name)
                instances.append(stage)
                task = _Task(bound.name, replica, stage, plan.settings.timeout_s)
                self._tasks.append(task)
                group.tasks.append(task)
            self._replicas[bound.name] = instances
            if hasattr(bound.cls, "live_sequences"):
                self.metrics.live_sequences.labels(bound.name).set_function(
                    functools.partial(self._live_sequences, bound.name)
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
        replicas = self._replicas[name]
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
        """True while the graph runs, no group restarts, no stage is overdue on a message,
        and no failure escalated (read by `/health`)."""
        return (
            self._running
            and self.failure is None
            and not any(group.restarting for group in self._groups.values())
            and not any(task.overdue for task in self._tasks)
        )

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
        return self._running

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def stages_here(self) -> tuple[str, ...]:
        """The names of the stages this process runs (all of them in an unplaced run)."""
        return tuple(self._replicas)

    def stage(self, name: str) -> Stage:
        """The stage object named `name` (its first replica), e.g. to call `submit()`."""
        return self.replicas(name)[0]

    def replicas(self, name: str) -> list[Stage]:
        try:
            return list(self._replicas[name])
        except KeyError:
            raise KeyError(f"graph {self.name!r} has no stage {name!r}") from None

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
        self.log.info("graph starting", stages=len(self._replicas), tasks=len(self._tasks))
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                watchdog = anyio.CancelScope()
                tg.start_soon(self._watchdog, watchdog)
                async with anyio.create_task_group() as groups:
                    for group in self._groups.values():
                        groups.start_soon(self._supervise, group, name=f"group {group.name}")
                    self._running = True
                    task_status.started(self)
                watchdog.cancel()
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
        on_stop = None
        if not self._stopping:
            on_stop = self._on_stop
            self._stopping = True
            self.log.info("graph stopping", timeout_s=timeout)
            self._stop_requested.set()
            for task in self._tasks:
                try:
                    await task.stage.stop_intake()
                except Exception as exc:
                    self.log.warning("stop_intake raised", stage=task.name, exc_info=exc)
        with anyio.move_on_after(timeout):
            if on_stop is not None:
                await on_stop()
            await self._done.wait()
            return self.failure is None
        self.log.warning("graph did not drain in time; cancelling", timeout_s=timeout)
        if self.failure is None:
            # Answer what is still in flight (deliver sends each open request an error)
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
                port: channel.receiver()
                for port in bound.cls.inputs
                # an optional port may be unwired; an input here is a local channel
                if isinstance(channel := self.channels.get(f"{task.name}.{port}"), Channel)
            }
            outboxes = {}
            for port in bound.cls.outputs:
                targets = spec.fanout.get(PortRef(task.name, port))
                if targets:  # an optional port may be unwired
                    outboxes[port] = Outbox(port, [self.channels[t].sender() for t in targets])
            log = self.log.bind(stage=task.name, replica=task.replica)
            task.ctx = StageContext(
                name=task.name,
                replica=task.replica,
                inboxes=inboxes,
                outboxes=outboxes,
                log=log,
                fail_request=self._fail_request,
                spans=SpanRecorder(
                    task.name,
                    log,
                    self.metrics,
                    enabled=self._spans,
                    events=self._span_events,
                    sinks=self._span_sinks,  # shared: sinks may come and go
                ),
                stop_requested=self._stop_requested,
            )
            task.stage.bind(task.ctx)
        for fed, local in self._fed_from_afar:
            far = {self.spec.placement[p.stage] for p in fed.producers} - {self.process}
            self._require_boundary(fed).inbound(fed, local, sorted(far))
        for channel in self.channels.values():
            channel.close()

    async def _supervise(self, group: _Group) -> None:
        """Run the group's members; rebuild and run them again after each restart."""
        while True:
            group.restart_cause = None
            async with anyio.create_task_group() as members:
                group.scope = members.cancel_scope
                for task in group.tasks:
                    members.start_soon(
                        self._run_member, task, group, name=f"{task.name}[{task.replica}]"
                    )
            if group.restart_cause is None or not await self._restart(group):
                return

    async def _run_member(self, task: _Task, group: _Group) -> None:
        ctx = task.ctx
        if ctx is None:
            raise RuntimeError(f"stage {task.name!r} was not wired")
        while True:
            error: Exception | None = None
            with anyio.CancelScope() as scope:
                task.scope = scope
                try:
                    await task.stage.run(ctx)
                except Exception as exc:
                    error = exc
                else:
                    task.finished = True
                    ctx.close_outputs()
                    late = await self._drain_late(ctx)
                    ctx.log.debug("stage finished", late_messages_dropped=late)
                    ctx.close()
                    return
            task.scope = None
            message = ctx.busy_message if ctx.busy_since else None
            elapsed = perf_counter() - ctx.busy_since if ctx.busy_since else 0.0
            if message is not None:  # the failed message's span, as any other's
                ctx.spans.record(message, ctx.busy_since, ctx.last_wait)
            ctx.end()
            if error is None:
                if not task.timed_out:
                    return  # cancelled: its group restarts or the graph stops
                error = StageTimeout(
                    f"stage {task.name!r} spent {elapsed:.1f} s on one message, past its "
                    f"timeout of {task.timeout_s} s"
                )
            task.timed_out = False
            if not await self._on_failure(task, group, error, message):
                return

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

    def _request_ids(self, task: _Task, group: _Group, message: object) -> tuple[str, ...]:
        """The requests of `message`, asked of every stage in the group (for a step, the
        stage that knows which requests its sequences belong to answers)."""
        if message is None:
            return ()
        ids: dict[str, None] = {}
        for member in [task, *(t for t in group.tasks if t is not task)]:
            try:
                ids.update(dict.fromkeys(member.stage.request_ids(message)))
            except Exception as exc:  # a damaged stage may not know; never mask the failure
                self.log.warning("request_ids raised", stage=member.name, exc_info=exc)
        return tuple(ids)

    async def _on_failure(
        self, task: _Task, group: _Group, error: Exception, message: object
    ) -> bool:
        """Apply the group's policy to one failure; True when the member runs on."""
        self.metrics.stage_errors.labels(task.name).inc()
        log = self.log.bind(stage=task.name, replica=task.replica)
        if self.failure is not None:
            # The graph is already going down; later errors are usually its consequences.
            log.warning("stage raised while the graph was failing", exc_info=error)
            return False
        request_ids = self._request_ids(task, group, message)
        if isinstance(error, RequestInputError):
            log.info("request refused by its own input", request_ids=request_ids, error=str(error))
            await self._answer(task, request_ids, error, "invalid_request", message)
            return True
        on_error = group.on_error
        if on_error != "escalate" and not group.intensity.admit():
            log.error(
                "stage failed past its group's restart intensity; escalating",
                group=group.name,
                max_restarts=group.intensity.max_restarts,
                within_s=group.intensity.within_s,
                request_ids=request_ids,
                exc_info=error,
            )
            on_error = "escalate"
        elif self._stopping or (on_error == "restart" and any(t.finished for t in group.tasks)):
            on_error = "escalate"  # a group that is draining cannot start over
        else:
            log.error("stage failed", on_error=on_error, request_ids=request_ids, exc_info=error)
        if on_error == "escalate":
            await self._escalate(task, error)
            return False
        await self._answer(task, request_ids, error, "internal", message)
        if on_error == "fail_request":
            return True
        group.restart_cause = error
        group.restarting = True
        if group.scope is not None:
            group.scope.cancel()
        return False

    async def _answer(
        self,
        task: _Task,
        request_ids: tuple[str, ...],
        error: Exception,
        kind: ErrorKind,
        message: object = None,
    ) -> None:
        """Answer each request with the failure, through the stage (bounded in time)."""
        if not request_ids:
            return
        if kind == "invalid_request":
            text = str(error)
        else:
            text = f"The {task.name} stage failed on this request: {type(error).__name__}"
        errors = [
            RequestError(
                request_id=request_id,
                message=text,
                kind=kind,
            )
            for request_id in request_ids
        ]
        with anyio.move_on_after(self._fail_inflight_timeout, shield=True):
            try:
                await task.stage.fail_requests(errors, message)
                return
            except Exception as exc:
                self.log.warning("fail_requests raised", stage=task.name, exc_info=exc)
        if self._fail_request is not None:
            for request_error in errors:
                self._fail_request(request_error)

    async def _restart(self, group: _Group) -> bool:
        """Build the group's stages anew on the same channels; False if that failed."""
        members = {task.name for task in group.tasks}
        try:
            for name in members:
                for port in self.spec.stages[name].cls.inputs:
                    channel = self.spec.channels.get(f"{name}.{port}")
                    if channel is not None and all(p.stage in members for p in channel.producers):
                        dropped = self._discard(group, name, port)
                        self.log.debug("discarded on restart", channel=channel.name, n=dropped)
            for task in group.tasks:
                fresh = self._build(task.name)
                fresh.restart_from(task.stage)
                task.stage.bind(None)
                fresh.bind(task.ctx)
                self._replicas[task.name][task.replica] = fresh
                task.stage = fresh
        except Exception as exc:
            self.log.error("group could not restart", group=group.name, exc_info=exc)
            await self._escalate(group.tasks[0], exc)
            return False
        self.metrics.stage_restarts.labels(group.name).inc()
        group.restarting = False
        self.log.warning("group restarted", group=group.name, cause=repr(group.restart_cause))
        return True

    @staticmethod
    def _discard(group: _Group, name: str, port: str) -> int:
        """Drop what waits on a channel inside the group: messages of the failed run."""
        task = next(t for t in group.tasks if t.name == name)
        assert task.ctx is not None
        inbox = task.ctx.inbox(port)
        dropped = 0
        while True:
            try:
                inbox.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                return dropped
            dropped += 1

    async def _watchdog(self, scope: anyio.CancelScope) -> None:
        """Cancel a member that has spent longer than its timeout on one message."""
        timed = [task for task in self._tasks if task.timeout_s is not None]
        if not timed:
            return
        interval = min(1.0, max(0.05, min(t.timeout_s or 1.0 for t in timed) / 4))
        with scope:
            await self._watch(timed, interval)

    async def _watch(self, timed: list[_Task], interval: float) -> None:
        while True:
            await anyio.sleep(interval)
            now = perf_counter()
            for task in timed:
                ctx = task.ctx
                if ctx is None:
                    continue
                if not ctx.busy_since:
                    task.overdue = False  # idle again: healthy
                    continue
                if task.timed_out or task.scope is None:
                    continue
                elapsed = now - ctx.busy_since
                if elapsed > (task.timeout_s or 0.0):
                    group = self._groups[self.spec.stages[task.name].supervision.group]
                    task.overdue = task.timed_out = True
                    self.log.error(
                        "stage overdue on one message; cancelling it",
                        stage=task.name,
                        replica=task.replica,
                        timeout_s=task.timeout_s,
                        elapsed_s=round(elapsed, 3),
                        request_ids=self._request_ids(task, group, ctx.busy_message),
                    )
                    task.scope.cancel()

    async def _escalate(self, task: _Task, error: BaseException) -> None:
        """Fail everything in flight and stop the graph: the process should exit."""
        if self.failure is not None:
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
