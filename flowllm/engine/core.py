"""The engine core: the step loop's stages and the model, in a process of their own.

A graph placed across processes (flowllm/engine/default.yaml) runs its per-request
stages with the HTTP server in the front processes and the rest here. The core loads the
model, listens on a Unix socket (on TCP when it is a Ray replica, flowllm/scale_out/), and
runs its part of the graph with one `Peer` per front (flowllm/graph/remote.py);
`Ownership` sends each front the outputs of its own requests. A front that goes away has
its requests aborted here, so their blocks are freed; the core beats (`Heartbeat`) to
every front, which is what their `/health` reads.

`CoreSpec` is everything the process needs, picklable, so that the process that
supervises it (flowllm/cli/processes.py) can start it, and start it again.
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import itertools
import multiprocessing
import multiprocessing.process
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import structlog
from prometheus_client import generate_latest

from flowllm import collector, openmp
from flowllm.config import EngineConfig
from flowllm.engine.core_protocol import (
    CONTROL_DECODER,
    HEARTBEAT_INTERVAL_S,
    SIBLING_METRICS_TIMEOUT_S,
    CheckGrammar,
    CoreReady,
    FailRequest,
    GrammarChecked,
    Heartbeat,
    Hello,
    MetricsQuery,
    MetricsReply,
    Refused,
)
from flowllm.engine.ownership import Ownership
from flowllm.engine.span_relay import SpanRelay, Spans, WantSpans
from flowllm.graph.channel import type_members
from flowllm.graph.problems import GraphValidationError
from flowllm.graph.remote import Boundary, Peer, PeerGone
from flowllm.graph.runtime import Graph
from flowllm.graph.transport import keep_alive, listen, send_all
from flowllm.graph.validator import ValidGraph, load_graph
from flowllm.graph.wire import (
    CONTROL,
    WireError,
    channel_codecs,
    encode_control,
    read_one_frame,
    wiring_digest,
)
from flowllm.logging_config import configure_logging
from flowllm.messages import Abort, RequestError
from flowllm.models import glibc_heap
from flowllm.sampling.grammar import GrammarError
from flowllm.stages.worker import name_os_thread

if TYPE_CHECKING:  # the supervisor imports this module, and needs no torch
    from flowllm.graph.spec import GraphSpec
    from flowllm.stages.services import EngineServices

# Exit statuses of the core and front processes, read by their supervisor.
EXIT_ESCALATED = 70  # the graph failed past its supervision (sysexits' EX_SOFTWARE)
# A greeting comes before the token is checked (a core on TCP is reachable by anyone on
# its network): it is read only up to this, not up to a channel frame's bound.
HELLO_MAX_BYTES = 64 * 1024
EXIT_INVALID_GRAPH = 78  # the graph did not validate; the supervisor says why (EX_CONFIG)

ServicesBuilder = Callable[..., "EngineServices"]
"""Called in the core process as `build(config, tokenizer_now=False)`; picklable (a module's
function, or a partial of one): what loads the model there. The default is
`flowllm.engine.loading.build_services`; a benchmark passes one with a stand-in model."""


@dataclass(frozen=True)
class CoreSpec:
    """How to start a core: the engine config, the graph file, where to listen."""

    config: EngineConfig
    graph_file: str
    address: str  # a Unix socket path, or HOST:PORT (flowllm/graph/transport.py)
    fronts: int  # how many front processes connect (--api-server-count)
    token: str = ""  # what a front's Hello must carry
    threads: int | None = None  # torch's intra-op threads (None: torch's default)
    log_format: str | None = None
    log_level: str | None = None
    stop_timeout: float = 30.0


def placement_of(graph: ValidGraph | GraphSpec) -> tuple[str, str]:
    """The front's and the core's process names of a placed graph (or of its file, read
    before its stages are imported): the front is where `ingest` runs (requests enter
    there), the core is the one other process."""
    if "ingest" not in graph.placement:
        raise ValueError(f"graph {graph.name!r} has no 'ingest' stage to take requests")
    front = graph.placement["ingest"]
    processes = tuple(dict.fromkeys(graph.placement.values()))
    others = [p for p in processes if p != front]
    if len(others) != 1:
        raise ValueError(
            f"graph {graph.name!r} is placed in {len(processes)} processes "
            f"({', '.join(processes)}); flowllm runs the front (where 'ingest' is) "
            "and one core process"
        )
    return front, others[0]


def start_core(
    spec: CoreSpec, build: ServicesBuilder | None = None
) -> multiprocessing.process.BaseProcess:
    """Start a core process (spawned: a fresh interpreter, whatever threads this one runs)
    whose services `build` makes (default: the model `spec.config` names, loaded)."""
    process = multiprocessing.get_context("spawn").Process(
        target=run_core, args=(spec, build), name="flowllm-core"
    )
    process.start()
    return process


def run_core(spec: CoreSpec, build: ServicesBuilder | None = None) -> None:
    """The core process's entry point: load (`build`, default `build_services`), serve the
    fronts, exit when told to."""
    glibc_heap.one_arena()  # before any thread starts
    collector.pause()  # until loaded
    become_child("flowllm-core")
    configure_logging(fmt=spec.log_format, level=spec.log_level, force=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor handles Ctrl-C
    import torch

    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    if build is None:
        from flowllm.engine.loading import build_services

        build = build_services

    graph = load_graph_or_exit(spec.graph_file)
    services = build(spec.config, tokenizer_now=False)
    collector.settle()
    code = anyio.run(_serve_until_sigterm, spec, graph, services)
    os._exit(code)  # no interpreter teardown: the model's memory goes with the process


def load_graph_or_exit(path: str) -> ValidGraph:
    """A supervised child's graph; a graph that does not validate ends the child quietly
    (EXIT_INVALID_GRAPH): its supervisor validates the graph itself and says why, once."""
    try:
        return load_graph(path)
    except GraphValidationError:
        os._exit(EXIT_INVALID_GRAPH)


def become_child(name: str) -> None:
    """A supervised child's first act: take `name` (what `ps` and /proc/PID/comm show), ask
    Linux to end this process when its parent dies (no orphan keeps the port or the
    model), and leave the terminal's process group, so that Ctrl-C reaches the supervisor
    alone and it stops the children in order."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    name_os_thread(name)


class Core:
    """One run of the core's graph and its fronts' connections (constructed in the event
    loop that serves it)."""

    def __init__(self, spec: CoreSpec, graph: ValidGraph, services: EngineServices) -> None:
        self.spec = spec
        self.services = services
        self.log = structlog.get_logger("flowllm.core")
        front, core = placement_of(graph)
        self.wiring = wiring_digest(graph.channels)
        self.ownership = Ownership()
        codecs = channel_codecs(graph.channels)
        self.fronts = [
            Peer(
                front,
                index,
                codecs,
                on_control=self._on_control,
                undeliverable=lambda _name, _message: None,  # its front is gone: drop
                observe=self._arrived,
                replaceable=True,
            )
            for index in range(spec.fronts)
        ]
        # Where requests arrive from the fronts: aborts for a vanished front's go there.
        self._request_channels = [
            name
            for name, channel in graph.channels.items()
            if channel.crosses
            and graph.placement[channel.dst.stage] == core
            and Abort in (type_members(channel.message_type) or ())
        ]
        self.graph = Graph(
            graph,
            services,
            registry=services.registry,
            fail_request=self._fail_request,
            process=core,
            boundary=Boundary({front: self.fronts}, self.ownership.route),
        )
        self._span_wanted: set[int] = set()  # fronts whose span sinks want the core's spans
        self.spans = SpanRelay(self._send_spans)
        self.graph.span_sinks.add(self.spans)
        self._stop = anyio.Event()
        self._tasks: anyio.abc.TaskGroup | None = None  # serve's, while it runs
        # the core's metrics queries to fronts: id -> (the replies, how many, all in)
        self._fronts_asked: dict[int, tuple[list[bytes], int, anyio.Event]] = {}
        self._metrics_queries = itertools.count()

    @property
    def serving(self) -> bool:
        """The core's graph runs and has not failed for good."""
        return self.graph.running and not self.graph.failed

    @property
    def busy(self) -> bool:
        """A connected front has requests running here."""
        return len(self.ownership) > 0 and any(peer.attached for peer in self.fronts)

    def stop(self) -> None:
        """Stop serving: the graph drains (up to the spec's `stop_timeout`), `serve` returns.
        The fronts should have drained first: nothing more is taken from them."""
        self._stop.set()

    def _arrived(self, peer: Peer, _channel: str, message: object) -> None:
        self.ownership.arrived(peer.index, message)

    def _on_control(self, peer: Peer, payload: Any) -> None:
        message = CONTROL_DECODER.decode(payload)
        if isinstance(message, MetricsQuery):
            others = [front for front in self.fronts if front is not peer and front.attached]
            if others and self._tasks is not None:
                self._tasks.start_soon(self._answer_metrics, peer, message.query, others)
            else:
                text = generate_latest(self.services.registry)
                peer.send_control(MetricsReply(query=message.query, text=text))
        elif isinstance(message, MetricsReply):  # a front answers the core's query
            asked = self._fronts_asked.pop(message.query, None)
            if asked is not None:
                replies, expected, all_in = asked
                replies.append(message.text)
                if len(replies) == expected:
                    all_in.set()
        elif isinstance(message, CheckGrammar):
            if self._tasks is not None:
                self._tasks.start_soon(self._check_grammar, peer, message)
        elif isinstance(message, WantSpans):
            if message.want:
                self._span_wanted.add(peer.index)
            else:
                self._span_wanted.discard(peer.index)
            self.spans.wanted = bool(self._span_wanted)
        else:
            self.log.warning("unexpected control message from a front", front=peer.index)

    async def _answer_metrics(self, asker: Peer, query: int, others: list[Peer]) -> None:
        """Answer a front's metrics query with the core's registry and the other fronts'
        (those that answer within SIBLING_METRICS_TIMEOUT_S)."""
        replies: list[bytes] = []
        all_in = anyio.Event()
        asked = []
        for front in others:
            sibling_query = next(self._metrics_queries)
            asked.append(sibling_query)
            self._fronts_asked[sibling_query] = (replies, len(others), all_in)
            front.send_control(MetricsQuery(query=sibling_query))
        with anyio.move_on_after(SIBLING_METRICS_TIMEOUT_S):
            await all_in.wait()
        for sibling_query in asked:
            self._fronts_asked.pop(sibling_query, None)
        text = generate_latest(self.services.registry)
        asker.send_control(MetricsReply(query=query, text=text, fronts=tuple(replies)))

    async def _check_grammar(self, front: Peer, message: CheckGrammar) -> None:
        """Compile a front's constraint (a thread; its grammar cache is the guide's)."""
        grammars = self.services.grammars
        try:
            await anyio.to_thread.run_sync(lambda: grammars().compile(message.spec))
        except GrammarError as exc:
            reply = GrammarChecked(query=message.query, message=exc.message, param=exc.param)
        else:
            reply = GrammarChecked(query=message.query)
        if front.attached:
            front.send_control(reply)

    def _send_spans(self, spans: Spans) -> None:
        for front in self._span_wanted:
            self.fronts[front].send_control(spans)

    def _fail_request(self, error: RequestError) -> None:
        front = self.ownership.front_of_request(error.request_id)
        if front is not None:
            self.fronts[front].send_control(FailRequest(error))

    def ready(self) -> CoreReady:
        services = self.services
        return CoreReady(
            max_model_len=services.max_model_len,
            vocab_size=services.logits_size,
            eos_token_ids=services.eos_token_ids,
            num_blocks=services.num_blocks,
            pid=os.getpid(),
            healthy=self.graph.healthy,
            pooler=services.pooler,
        )

    async def serve(
        self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED
    ) -> int:
        """Listen and serve the fronts until `stop()` or the graph's end; the exit status.
        Started with `TaskGroup.start`, it reports the address it listens on. The loop's
        thread runs its torch work on one OpenMP thread meanwhile (flowllm/openmp.py)."""
        listener, address = await listen(self.spec.address)
        with openmp.one_thread():
            async with anyio.create_task_group() as tg:
                self._tasks = tg
                await tg.start(self.graph.run)
                for peer in self.fronts:
                    tg.start_soon(peer.pump_overflow)
                tg.start_soon(self._heartbeat)
                tg.start_soon(listener.serve, self._connection)
                self.log.info(
                    "engine core ready",
                    address=address,
                    fronts=len(self.fronts),
                    threads=self.services.model_threads,
                )
                task_status.started(address)
                # Ready first; the tokenizer (which grammars need) then loads in a thread, so
                # that the first constrained request does not wait for transformers' import.
                threading.Thread(
                    target=lambda: self.services.tokenizer, name="flowllm-tokenizer", daemon=True
                ).start()
                with anyio.CancelScope() as waiting:
                    tg.start_soon(self._end_with_graph, waiting)
                    await self._stop.wait()
                if not self.graph.finished:
                    # Stopping: the fronts have drained; nothing more comes from them.
                    for peer in self.fronts:
                        peer.close_inbound()
                    await self.graph.stop(self.spec.stop_timeout)
                tg.cancel_scope.cancel()
            await listener.aclose()
            return EXIT_ESCALATED if self.graph.failed else 0

    async def _end_with_graph(self, waiting: anyio.CancelScope) -> None:
        await self.graph.wait_finished()
        waiting.cancel()

    async def _heartbeat(self) -> None:
        while True:
            message = Heartbeat(healthy=self.graph.healthy)
            for peer in self.fronts:
                peer.send_control(message)
            await anyio.sleep(HEARTBEAT_INTERVAL_S)

    async def _connection(self, sock: socket.socket) -> None:
        keep_alive(sock)
        try:
            with anyio.fail_after(5):
                frame = await read_one_frame(sock, HELLO_MAX_BYTES)
            hello = CONTROL_DECODER.decode(frame.payload) if frame.kind == CONTROL else None
        except (TimeoutError, WireError, anyio.EndOfStream, OSError, ValueError) as exc:
            self.log.warning("a connection did not greet the core", error=repr(exc))
            sock.close()
            return
        reason = self._refusal(hello)
        if reason is not None or not isinstance(hello, Hello):
            self.log.error("front refused", reason=reason)
            try:
                await send_all(sock, encode_control(Refused(reason or "no hello")))
            finally:
                sock.close()
            return
        peer = self.fronts[hello.front]
        self.log.info("front connected", front=hello.front, pid=hello.pid)
        with contextlib.suppress(PeerGone):
            await peer.attach(sock, greeting=self.ready())
        self._front_gone(hello.front)

    def _refusal(self, hello: object) -> str | None:
        if not isinstance(hello, Hello):
            return f"expected a Hello, got {type(hello).__name__}"
        if not hmac.compare_digest(hello.token.encode(), self.spec.token.encode()):
            return "the front does not hold this core's token"
        if hello.wiring != self.wiring:
            return "the front runs another graph than the core"
        if not 0 <= hello.front < len(self.fronts):
            return f"front {hello.front} is not among the {len(self.fronts)} this core serves"
        if self.fronts[hello.front].attached:
            return f"front {hello.front} is already connected"
        return None

    def _front_gone(self, front: int) -> None:
        """Abort what the front had running: nobody is left to read it."""
        self._span_wanted.discard(front)
        self.spans.wanted = bool(self._span_wanted)
        request_ids = self.ownership.requests_of(front)
        # A warning when requests are lost; a front leaving idle is how a server stops.
        emit = self.log.warning if request_ids else self.log.info
        emit("front disconnected", front=front, aborted=len(request_ids))
        if not self._request_channels:
            return
        peer = self.fronts[front]
        for request_id in request_ids:
            peer.inject(self._request_channels[0], Abort(request_id, reason="front gone"))


async def _serve_until_sigterm(spec: CoreSpec, graph: ValidGraph, services: EngineServices) -> int:
    core = Core(spec, graph, services)
    async with anyio.create_task_group() as tg:
        tg.start_soon(_stop_on_sigterm, core)
        code = await core.serve()
        tg.cancel_scope.cancel()
    return code


async def _stop_on_sigterm(core: Core) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
        async for _ in signals:
            core.stop()
