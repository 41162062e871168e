"""The Stage contract: ports, params, a `run` over a context, and hooks the runtime calls.

A stage class declares

    inputs = {"in": TokenizedRequest | Abort}          # port -> message type (a union is fine)
    outputs = {"out": StepBatch, "errors": RequestError}
    class Params(msgspec.Struct, frozen=True): ...      # built from the YAML `with:` map
    credit_param = "max_inflight_steps"                 # only for a stage bounding a cycle
    per_step_outputs = frozenset({"choices"})           # ports sending <= 1 message a step

and is constructed by the runtime as `StageClass(params, services)`. `run(ctx)` receives
from `ctx`'s inboxes and emits on its outboxes; it returns once its inputs are closed and
drained, after which the runtime closes its outboxes so the end propagates downstream.

Three shapes cover the graph:

- `PerMessageStage`: receive one, emit zero or more. Write `handle(message, ctx)`.
- `SourceStage`: no inputs; the graph's owner calls its methods (`graph.stage("ingest")`)
  and they emit through `self.context`. It runs until a graceful stop is requested.
- A hand-written `run` for stages with several inputs (like `schedule`): call
  `ctx.receive_any("step_results", "finishes", "requests")`, which waits without polling
  until any of the named inputs has a message and checks them in the order given, so the
  first port has priority. A port that has closed and drained is reported once as
  `(port, CLOSED)`, which is how a stage on a cycle learns that its intake has ended and
  can return when nothing is in flight. Handle each message inside
  `with ctx.handling(message):`, the bookkeeping every shape shares (watchdog, span).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from time import perf_counter
from types import TracebackType
from typing import Any, ClassVar, Final, Protocol, TypeVar, runtime_checkable

import anyio
import anyio.lowlevel
import msgspec
from structlog.typing import FilteringBoundLogger

from flowllm.graph.channel import ChannelReceiver, Waiter
from flowllm.graph.spans import SpanRecorder
from flowllm.messages import RequestError, request_ids_of

T = TypeVar("T")


class NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The params of a stage that takes none."""


class StageNotRunningError(RuntimeError):
    """A stage's outboxes were used before the graph started it (or after it ended)."""


class RequestInputError(ValueError):
    """Raised by a stage when the request's own input makes it fail: the supervisor
    answers that request with a 400 and does not count it as the stage's failure."""


# How a stage answers a request when the graph's owner gives no way (a bare graph).
FailRequest = Callable[[RequestError], object]


class _Closed:
    """The marker `receive_any` returns once for an input that has closed and drained."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CLOSED"


CLOSED: Final = _Closed()


class _HasCapacity(Protocol):
    @property
    def capacity(self) -> int: ...


class Sender(Protocol):
    """A send end: a local channel's (`ChannelSender`) or a cross-process one's
    (flowllm/graph/remote.py's `RemoteSender`)."""

    @property
    def channel(self) -> _HasCapacity: ...

    async def send(self, message: Any) -> None: ...

    def send_nowait(self, message: Any) -> None: ...

    def has_room(self) -> bool: ...

    def room(self) -> int: ...

    def close(self) -> None: ...


class Outbox:
    """One output port of one stage task: a sender per connected channel (fan-out)."""

    __slots__ = ("_one", "port", "senders")

    def __init__(self, port: str, senders: Sequence[Sender]) -> None:
        self.port = port
        self.senders = senders
        # The common case, one consumer channel, skips the loop.
        self._one = senders[0] if len(senders) == 1 else None

    async def send(self, message: object) -> None:
        """Send to every connected channel, waiting while any is full."""
        if self._one is not None:
            await self._one.send(message)
            return
        for sender in self.senders:
            await sender.send(message)

    def has_room(self) -> bool:
        return all(sender.has_room() for sender in self.senders)

    def room(self) -> int:
        """How many messages `send_nowait` would take now, in a row."""
        return min(sender.room() for sender in self.senders)

    @property
    def capacity(self) -> int:
        """The most messages this port could ever take at once (its smallest channel's)."""
        return min(sender.channel.capacity for sender in self.senders)

    def send_nowait(self, message: object) -> None:
        """Send now to every channel or to none; raises `anyio.WouldBlock` when any is full."""
        if not self.has_room():
            raise anyio.WouldBlock
        for sender in self.senders:
            sender.send_nowait(message)

    def close(self) -> None:
        for sender in self.senders:
            sender.close()


class StageContext:
    """What a running stage task sees: its inboxes, outboxes, logger and stop signal.

    One context per task: each replica of a stage has its own, holding its own channel
    clones. `last_wait` is the queue wait of the message most recently received through
    the context, which `handling()` records by default.

    Received messages are typed `Any`: a port's type is a value declared in `inputs`,
    checked per edge by the graph validator and per send by the channel, and a stage
    states it in its own signatures (`handle(self, message: StepBatch, ...)`).
    """

    def __init__(
        self,
        *,
        name: str,
        replica: int,
        inboxes: Mapping[str, ChannelReceiver[Any]],
        outboxes: Mapping[str, Outbox],
        log: FilteringBoundLogger,
        spans: SpanRecorder,
        stop_requested: anyio.Event,
        fail_request: FailRequest | None = None,
    ) -> None:
        self.name = name
        self.replica = replica
        self.log = log
        self.spans = spans
        self.stop_requested = stop_requested  # set when the graph's owner asks for a stop
        self.last_wait = 0.0
        # What the watchdog reads: since when (perf_counter) the stage handles which
        # message; 0.0 while it waits for input. Set by `handling`.
        self.busy_since = 0.0
        self.busy_message: object = None
        self._busy_wait = 0.0
        self._handling = _Handling(self)
        self._kept: object = None  # see `keep`
        # The graph owner's way to answer a request directly (the engine hands it to
        # deliver), for stages without an `errors` port.
        self.fail_request = fail_request
        self._inboxes = dict(inboxes)
        self._outboxes = dict(outboxes)
        self._input_order = tuple(self._inboxes)
        self._inbox_lists: dict[tuple[str, ...], tuple[tuple[str, ChannelReceiver[Any]], ...]] = {}
        # Port -> the message `receive_any` took there and its queue wait, until it returns
        # it (see there).
        self._held: dict[str, tuple[Any, float]] = {}
        self._reported_closed: set[str] = set()
        self._closed = False

    # -- inputs ---------------------------------------------------------------------------

    @property
    def input_ports(self) -> tuple[str, ...]:
        return self._input_order

    @property
    def output_ports(self) -> tuple[str, ...]:
        """The connected output ports (an optional one may be unwired)."""
        return tuple(self._outboxes)

    def inbox(self, port: str) -> ChannelReceiver[Any]:
        try:
            return self._inboxes[port]
        except KeyError:
            raise KeyError(f"stage {self.name!r} has no input port {port!r}") from None

    async def receive(self, port: str) -> Any:
        """The next message on `port`; raises `anyio.EndOfStream` once closed and drained."""
        inbox = self.inbox(port)
        message = await inbox.receive()
        self.last_wait = inbox.last_wait
        return message

    def receive_nowait(self, port: str) -> Any:
        """A buffered message on `port`; raises `anyio.WouldBlock` or `anyio.EndOfStream`."""
        inbox = self.inbox(port)
        message = inbox.receive_nowait()
        self.last_wait = inbox.last_wait
        return message

    def input_closed(self, port: str) -> bool:
        """True once every producer of `port` has finished and its buffer is empty."""
        return self.inbox(port).exhausted

    async def receive_any(self, *ports: str) -> tuple[str, Any]:
        """Wait until any of `ports` (default: all inputs, declared order) has a message.

        Ports are checked in the order given, so earlier ports have priority. Returns
        `(port, message)`; a port that has closed and drained is returned once as
        `(port, CLOSED)` and skipped afterwards. Raises `anyio.EndOfStream` when every
        port has been reported closed. No polling: while nothing is buffered, the task
        sleeps on one future that the channels' send side resolves.
        """
        order = ports or self._input_order
        held = self._held
        if held:  # taken by a call cancelled at its yield
            for port in order:
                if port in held:
                    message, self.last_wait = held.pop(port)
                    return port, message
        closed = self._reported_closed
        inboxes = self._inbox_lists.get(order)
        if inboxes is None:
            inboxes = self._inbox_lists[order] = tuple((port, self.inbox(port)) for port in order)
        waited = False
        while True:
            waiting = False
            for port, inbox in inboxes:
                if port in closed:
                    continue
                if inbox.channel.nothing_to_read:
                    waiting = True
                    continue
                try:
                    message = inbox.receive_nowait()
                except anyio.WouldBlock:
                    waiting = True
                    continue
                except anyio.EndOfStream:
                    closed.add(port)
                    self.spans.input_closed(port)
                    message = CLOSED
                else:
                    self.last_wait = inbox.last_wait
                if not waited:
                    # One yield per call, so that a stage whose inputs are always ready
                    # still lets the others run. The message is taken already: held across
                    # the yield, it is what the next call returns if this one is cancelled
                    # there (a restarted stage's next incarnation shares this context).
                    held[port] = (message, self.last_wait)
                    await anyio.lowlevel.checkpoint()
                    del held[port]
                return port, message
            if not waiting:
                raise anyio.EndOfStream
            # Nothing buffered: sleep until a send or close on any open port. No await
            # separates the checks above from registering, so no wake-up can be missed.
            waiter: Waiter = asyncio.get_running_loop().create_future()
            live = [inbox for port, inbox in inboxes if port not in closed]
            for inbox in live:
                inbox.add_waiter(waiter)
            try:
                await waiter
            finally:
                for inbox in live:
                    inbox.remove_waiter(waiter)
            waited = True

    # -- outputs --------------------------------------------------------------------------

    def outbox(self, port: str) -> Outbox:
        if self._closed:
            raise StageNotRunningError(f"stage {self.name!r} has finished; it cannot emit")
        try:
            return self._outboxes[port]
        except KeyError:
            raise KeyError(f"stage {self.name!r} has no output port {port!r}") from None

    async def emit(self, port: str, message: object) -> None:
        """Send `message` on output `port`, waiting while a consumer channel is full."""
        await self.outbox(port).send(message)

    def emit_nowait(self, port: str, message: object) -> None:
        """Send now or raise `anyio.WouldBlock` (for callers that must not wait)."""
        self.outbox(port).send_nowait(message)

    def keep(self, state: T) -> T:
        """What outlives the stage's restarts: the state the first incarnation passed here,
        returned to every later one. The supervisor hands the same context to each
        incarnation of a stage and throws the failed one away, so state a stage must not
        lose lives here, never read from its failed predecessor."""
        if self._kept is None:
            self._kept = state
        return self._kept  # type: ignore[return-value]

    # -- per-message bookkeeping ----------------------------------------------------------

    def handling(self, message: object, queue_wait: float | None = None) -> _Handling:
        """`with ctx.handling(message):` around the handling of one message.

        Marks the stage busy with `message` (the watchdog times it, a failure answers its
        requests) and, when the block ends without error, records its span with
        `queue_wait` (default: `last_wait`). `None` marks work driven by no message
        (schedule planning a step): timed by the watchdog, no span. An exception leaves
        the mark for the supervisor, which calls `abandon`.
        """
        self.busy_message = message
        self._busy_wait = self.last_wait if queue_wait is None else queue_wait
        self.busy_since = perf_counter()
        return self._handling

    def abandon(self) -> tuple[object, float]:
        """The stage raised or was cancelled: record the span of the message it was
        handling, clear the mark, and return that message (None if idle) and how long it
        was handled."""
        if not self.busy_since:
            return None, 0.0
        message, elapsed = self.busy_message, perf_counter() - self.busy_since
        self._handled()
        return message, elapsed

    def _handled(self) -> None:
        message, started = self.busy_message, self.busy_since
        self.busy_since = 0.0
        self.busy_message = None
        if message is not None:
            self.spans.record(message, started, self._busy_wait)

    def close_outputs(self) -> None:
        """Close this task's outboxes, so the end propagates downstream."""
        self._closed = True
        for outbox in self._outboxes.values():
            outbox.close()

    async def finish(self) -> int:
        """The stage returned: close its outboxes, then discard what still arrives on its
        open inputs until they close, and close its clones; returns how many were dropped.

        A stage on a cycle ends by its own decision (e.g. schedule, once its request input
        has closed and nothing is in flight) while other inputs may still be open; a late
        message there (a stop-string Finish racing the last step) is no longer needed.
        Draining instead of closing keeps its producers from failing or blocking.
        """
        self.close_outputs()
        dropped = 0
        while True:
            try:
                _port, message = await self.receive_any()
            except anyio.EndOfStream:
                break
            if message is not CLOSED:
                dropped += 1
        self.close()
        return dropped

    def close(self) -> None:
        """Close this task's channel clones; called by the runtime when the task ends."""
        self.close_outputs()
        for inbox in self._inboxes.values():
            inbox.close()


class _Handling:
    """What `StageContext.handling` returns: one per context, reused for every message."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: StageContext) -> None:
        self._ctx = ctx

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self._ctx._handled()


class Stage:
    """Base class of every stage. Subclasses declare ports and params and implement `run`."""

    inputs: ClassVar[dict[str, object]] = {}  # port -> a message type, or a union of them
    outputs: ClassVar[dict[str, object]] = {}
    Params: ClassVar[type[msgspec.Struct]] = NoParams
    # Input ports a graph may leave unconnected: the stage then runs without them (it
    # sees only connected ports in `ctx.input_ports`).
    optional_inputs: ClassVar[frozenset[str]] = frozenset()
    # Output ports a graph may leave unconnected: the stage then skips what it would send
    # there (it sees only connected ports in `ctx.output_ports`).
    optional_outputs: ClassVar[frozenset[str]] = frozenset()
    # Name of an int param bounding the messages this stage keeps in flight around a
    # cycle (docs/stages.md); the validator accepts a cycle only through such a stage.
    credit_param: ClassVar[str | None] = None
    # Output ports sending at most one message per credited step, beside the credited loop
    # rather than around it (schedule's `choices`). Steps stop only once the consumer's
    # input from the loop is full, so the validator sizes such a port's channel from that
    # input's capacity, the credit bound and one (docs/stages.md), not the bound alone.
    per_step_outputs: ClassVar[frozenset[str]] = frozenset()
    # Inputs joined by step, each read in its own order (sample's logits and masks): what
    # the stage sends does not depend on how their messages interleave, so a trace replay
    # feeds each input in send order instead of the recorded receive order.
    joins_inputs: ClassVar[bool] = False
    # What a failure does when the graph's `supervision:` entry does not say
    # (flowllm/graph/supervision.py): a stage with its own `run` may hold state across
    # requests, so it restarts with fresh state.
    on_error: ClassVar[str] = "restart"

    def __init__(self, params: msgspec.Struct, services: object) -> None:
        # A subclass that reads them declares their types: `params: MyParams`.
        self.params = params
        self.services = services
        self._context: StageContext | None = None

    @classmethod
    def credit_bound(cls, params: msgspec.Struct) -> int | None:
        """Messages this stage keeps in flight around a cycle at most, or None (unbounded)."""
        if cls.credit_param is None:
            return None
        value = getattr(params, cls.credit_param, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def context(self) -> StageContext:
        """This stage's context while the graph runs (for methods the graph's owner calls)."""
        if self._context is None:
            raise StageNotRunningError(f"{type(self).__name__} is not running in a graph")
        return self._context

    def bind(self, ctx: StageContext | None) -> None:
        """Called by the runtime before `run` (and with None after it ends)."""
        self._context = ctx

    async def run(self, ctx: StageContext) -> None:
        """Receive, work, emit; return once the inputs are closed and drained."""
        raise NotImplementedError(f"{type(self).__name__} must implement run()")

    async def stop_intake(self) -> None:
        """Graceful stop has begun: accept no new work (source stages override this)."""

    async def fail_inflight(self, error: BaseException) -> None:
        """A stage failed: fail every piece of work this stage can still answer.

        Called on every stage before the graph shuts down; `deliver` answers each open
        request with a 500 here. Must not wait on channels (they may be stuck).
        """

    def request_ids(self, message: object) -> tuple[str, ...]:
        """The requests `message` belongs to: those a failure while handling it fails."""
        return request_ids_of(message)

    async def fail_requests(self, errors: Iterable[RequestError], message: object = None) -> None:
        """Answer requests whose `message` this stage failed to handle.

        By default the errors go out on the `errors` port when the stage has one (so they
        travel behind the request's earlier output), else straight to the graph's owner.
        """
        ctx = self.context
        send = "errors" in type(self).outputs
        for error in errors:
            if send:
                await ctx.emit("errors", error)
            elif ctx.fail_request is not None:
                ctx.fail_request(error)
            else:
                ctx.log.warning("no way to answer a failed request", request_id=error.request_id)


@runtime_checkable
class CountsSequences(Protocol):
    """A stage that keeps state per live sequence reports how many (a gauge per stage)."""

    def live_sequences(self) -> int: ...


class PerMessageStage(Stage):
    """Receive one message, emit zero or more: implement `handle`.

    Messages are taken with `receive_any`, in declared port order when there are several
    (the first port has priority), and `handle` dispatches on the message's type. A failure
    in `handle` fails only that message's requests (unless the graph says otherwise).
    """

    on_error: ClassVar[str] = "fail_request"

    async def handle(self, message: Any, ctx: StageContext) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    async def run(self, ctx: StageContext) -> None:
        handle = self.handle
        while True:
            try:
                _port, message = await ctx.receive_any()
            except anyio.EndOfStream:
                return
            if message is CLOSED:
                continue
            with ctx.handling(message):
                await handle(message, ctx)


class SourceStage(Stage):
    """A stage with no inputs, fed by its owner's method calls; runs until a stop request.

    Methods emit through `self.context.emit(...)` / `emit_nowait(...)`. Override
    `stop_intake` to refuse new work at once when a graceful stop begins. Its owner holds
    the instance, so a source stage is never rebuilt: a failure escalates.
    """

    on_error: ClassVar[str] = "escalate"

    async def run(self, ctx: StageContext) -> None:
        await ctx.stop_requested.wait()
