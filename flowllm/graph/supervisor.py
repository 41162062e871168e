"""Supervise a graph's stage tasks as an Erlang/OTP supervisor does its children.

Failure policy lives here, apart from the wiring (flowllm/graph/runtime.py), so that what
a failure does is read in one place. The graph hands over its children, already wired,
each with its declared supervision (flowllm/graph/supervision.py, the YAML's
`supervision:`), and a way to build a stage anew and to discard a group's own messages.

The children of one group run in a task group of their own, each in a cancel scope the
watchdog can cancel. A child whose `run` raises (or outlives its `timeout_s` on one
message) is handled by its group's `on_error`: `fail_request` answers the requests of the
message it was handling and runs the stage on; `restart` cancels the group, discards the
messages on channels internal to it, builds every child anew and runs them on the same
channels and contexts (a context keeps what a stage must not lose, `StageContext.keep`);
`escalate`, or a group past its restart intensity, fails all in-flight work and stops
(the failure stays on `failure`).
`healthy` is false while a group restarts, a child is overdue, or a failure escalated.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from time import perf_counter

import anyio
from anyio.abc import TaskStatus
from structlog.typing import FilteringBoundLogger

from flowllm.graph.metrics import GraphMetrics
from flowllm.graph.stage import FailRequest, RequestInputError, Stage, StageContext
from flowllm.graph.supervision import RestartIntensity, SupervisionPlan
from flowllm.messages import ErrorKind, RequestError


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
class Child:
    """One replica of a stage under supervision: its declared plan and its running state."""

    name: str
    replica: int
    stage: Stage  # replaced by a fresh instance on each restart
    plan: SupervisionPlan
    ctx: StageContext | None = None  # set when the graph wires it
    scope: anyio.CancelScope | None = None  # the running child's, for the watchdog
    overdue: bool = False  # past its timeout on a message; unhealthy until seen idle
    timed_out: bool = False  # the watchdog cancelled it
    finished: bool = False  # its run returned: the end of its input reached it


@dataclass
class _Group:
    """Children supervised together: one policy, one restart intensity."""

    name: str
    on_error: str
    intensity: RestartIntensity
    children: list[Child] = field(default_factory=list)
    scope: anyio.CancelScope | None = None
    restart_cause: BaseException | None = None  # set when a child asks for a restart
    restarting: bool = False


class Supervisor:
    """Runs the children by group and applies each group's policy to their failures.

    `rebuild(name)` builds stage `name` anew; `discard(names)` drops what waits on the
    channels only those stages feed; `fail_request` answers a request whose stage could
    not. `fail_inflight_timeout` bounds each answer to failed work.
    """

    def __init__(
        self,
        children: Sequence[Child],
        *,
        rebuild: Callable[[str], Stage],
        discard: Callable[[Collection[str]], None],
        log: FilteringBoundLogger,
        metrics: GraphMetrics,
        fail_request: FailRequest | None,
        fail_inflight_timeout: float,
    ) -> None:
        self.children = children
        self._rebuild = rebuild
        self._discard = discard
        self._log = log
        self._metrics = metrics
        self._fail_request = fail_request
        self._fail_inflight_timeout = fail_inflight_timeout
        self.failure: StageFailure | None = None
        self.running = False
        self._scope: anyio.CancelScope | None = None
        self._groups: dict[str, _Group] = {}
        for child in children:
            plan = child.plan
            group = self._groups.get(plan.group)
            if group is None:
                intensity = RestartIntensity(plan.settings.max_restarts, plan.settings.within_s)
                group = self._groups[plan.group] = _Group(plan.group, plan.on_error, intensity)
            group.children.append(child)
        metrics.graph_healthy.set_function(lambda: 1.0 if self.healthy else 0.0)

    @property
    def healthy(self) -> bool:
        """True while the children run, no group restarts, no child is overdue on a
        message, and no failure escalated."""
        return (
            self.running
            and self.failure is None
            and not any(group.restarting for group in self._groups.values())
            and not any(child.overdue for child in self.children)
        )

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every group until all children have returned or a failure escalated."""
        try:
            async with anyio.create_task_group() as tg:
                self._scope = tg.cancel_scope
                watchdog = anyio.CancelScope()
                tg.start_soon(self._watchdog, watchdog)
                async with anyio.create_task_group() as groups:
                    for group in self._groups.values():
                        groups.start_soon(self._supervise, group, name=f"group {group.name}")
                    self.running = True
                    task_status.started()
                watchdog.cancel()
        finally:
            self.running = False

    async def fail_inflight(self, error: BaseException) -> None:
        """Call every child's `fail_inflight(error)`, shielded and bounded in time."""
        with anyio.move_on_after(self._fail_inflight_timeout, shield=True) as scope:
            for child in self.children:
                try:
                    await child.stage.fail_inflight(error)
                except Exception as exc:
                    self._log.warning("fail_inflight raised", stage=child.name, exc_info=exc)
        if scope.cancelled_caught:
            self._log.warning("fail_inflight timed out", timeout_s=self._fail_inflight_timeout)

    # -- running children -----------------------------------------------------------------

    async def _supervise(self, group: _Group) -> None:
        """Run the group's children; rebuild and run them again after each restart."""
        while True:
            group.restart_cause = None
            async with anyio.create_task_group() as children:
                group.scope = children.cancel_scope
                for child in group.children:
                    name = f"{child.name}[{child.replica}]"
                    children.start_soon(self._run_child, child, group, name=name)
            if group.restart_cause is None or not await self._restart(group):
                return

    async def _run_child(self, child: Child, group: _Group) -> None:
        ctx = child.ctx
        if ctx is None:
            raise RuntimeError(f"stage {child.name!r} was not wired")
        while True:
            error: Exception | None = None
            with anyio.CancelScope() as scope:
                child.scope = scope
                try:
                    await child.stage.run(ctx)
                except Exception as exc:
                    error = exc
                else:
                    child.finished = True
                    late = await ctx.finish()
                    ctx.log.debug("stage finished", late_messages_dropped=late)
                    return
            child.scope = None
            message, elapsed = ctx.abandon()
            if error is None:
                if not child.timed_out:
                    return  # cancelled: its group restarts or the graph stops
                error = StageTimeout(
                    f"stage {child.name!r} spent {elapsed:.1f} s on one message, past its "
                    f"timeout of {child.plan.settings.timeout_s} s"
                )
            child.timed_out = False
            if not await self._on_failure(child, group, error, message):
                return

    # -- failures -------------------------------------------------------------------------

    def _request_ids(self, child: Child, group: _Group, message: object) -> tuple[str, ...]:
        """The requests of `message`, asked of every stage in the group (for a step, the
        stage that knows which requests its sequences belong to answers)."""
        if message is None:
            return ()
        ids: dict[str, None] = {}
        for member in [child, *(c for c in group.children if c is not child)]:
            try:
                ids.update(dict.fromkeys(member.stage.request_ids(message)))
            except Exception as exc:  # a damaged stage may not know; never mask the failure
                self._log.warning("request_ids raised", stage=member.name, exc_info=exc)
        return tuple(ids)

    async def _on_failure(
        self, child: Child, group: _Group, error: Exception, message: object
    ) -> bool:
        """Apply the group's policy to one failure; True when the child runs on."""
        self._metrics.stage_errors.labels(child.name).inc()
        log = self._log.bind(stage=child.name, replica=child.replica)
        if self.failure is not None:
            # The graph is already going down; later errors are usually its consequences.
            log.warning("stage raised while the graph was failing", exc_info=error)
            return False
        request_ids = self._request_ids(child, group, message)
        if isinstance(error, RequestInputError):
            log.info("request refused by its own input", request_ids=request_ids, error=str(error))
            await self._answer(child, request_ids, error, "invalid_request", message)
            return True
        on_error = group.on_error
        # The graph's owner asked for a stop: the graph drains, and nothing starts over.
        draining = child.ctx is not None and child.ctx.stop_requested.is_set()
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
        elif draining or (on_error == "restart" and any(c.finished for c in group.children)):
            on_error = "escalate"  # a group that is draining cannot start over
        else:
            log.error("stage failed", on_error=on_error, request_ids=request_ids, exc_info=error)
        if on_error == "escalate":
            await self._escalate(child, error)
            return False
        await self._answer(child, request_ids, error, "internal", message)
        if on_error == "fail_request":
            return True
        group.restart_cause = error
        group.restarting = True
        if group.scope is not None:
            group.scope.cancel()
        return False

    async def _answer(
        self,
        child: Child,
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
            text = f"The {child.name} stage failed on this request: {type(error).__name__}"
        errors = [RequestError(request_id=rid, message=text, kind=kind) for rid in request_ids]
        with anyio.move_on_after(self._fail_inflight_timeout, shield=True):
            try:
                await child.stage.fail_requests(errors, message)
                return
            except Exception as exc:
                self._log.warning("fail_requests raised", stage=child.name, exc_info=exc)
        if self._fail_request is not None:
            for request_error in errors:
                self._fail_request(request_error)

    async def _restart(self, group: _Group) -> bool:
        """Build the group's stages anew on the same channels; False if that failed."""
        try:
            self._discard({child.name for child in group.children})
            for child in group.children:
                fresh = self._rebuild(child.name)
                child.stage.bind(None)
                fresh.bind(child.ctx)
                child.stage = fresh
        except Exception as exc:
            self._log.error("group could not restart", group=group.name, exc_info=exc)
            await self._escalate(group.children[0], exc)
            return False
        self._metrics.stage_restarts.labels(group.name).inc()
        group.restarting = False
        self._log.warning("group restarted", group=group.name, cause=repr(group.restart_cause))
        return True

    async def _escalate(self, child: Child, error: BaseException) -> None:
        """Fail everything in flight and stop: the process should exit."""
        if self.failure is not None:
            return
        self.failure = StageFailure(
            child.name, child.replica, error, "".join(traceback.format_exception(error))
        )
        self._log.error(
            "stage failed; failing in-flight work and shutting the graph down",
            stage=child.name,
            replica=child.replica,
            exc_info=error,
        )
        await self.fail_inflight(error)
        if self._scope is not None:
            self._scope.cancel()

    # -- the watchdog ---------------------------------------------------------------------

    async def _watchdog(self, scope: anyio.CancelScope) -> None:
        """Cancel a child that has spent longer than its timeout on one message."""
        timed = [
            (child, self._groups[child.plan.group])
            for child in self.children
            if child.plan.settings.timeout_s is not None
        ]
        if not timed:
            return
        shortest = min(child.plan.settings.timeout_s or 1.0 for child, _ in timed)
        interval = min(1.0, max(0.05, shortest / 4))
        with scope:
            while True:
                await anyio.sleep(interval)
                self._watch(timed, perf_counter())

    def _watch(self, timed: list[tuple[Child, _Group]], now: float) -> None:
        for child, group in timed:
            ctx = child.ctx
            if ctx is None:
                continue
            if not ctx.busy_since:
                child.overdue = False  # idle again: healthy
                continue
            if child.timed_out or child.scope is None:
                continue
            elapsed = now - ctx.busy_since
            timeout_s = child.plan.settings.timeout_s or 0.0
            if elapsed > timeout_s:
                child.overdue = child.timed_out = True
                self._log.error(
                    "stage overdue on one message; cancelling it",
                    stage=child.name,
                    replica=child.replica,
                    timeout_s=timeout_s,
                    elapsed_s=round(elapsed, 3),
                    request_ids=self._request_ids(child, group, ctx.busy_message),
                )
                child.scope.cancel()
