"""A front process's engine: the per-request stages here, the step loop in the core.

`FrontEngine.connect` connects to the core's socket (waiting for it to come up), learns
the model's facts from its `CoreReady`, loads the tokenizer meanwhile, and runs the
front's part of the graph with the core as its one `Peer`. Seen from the HTTP API and
the offline `LLM` it is an `AsyncEngine`; `healthy` also needs a core that beat within
`HEARTBEAT_STALE_S` and said it was healthy.

When the core goes away (it died, or was restarted by its supervisor), every request in
flight is answered at once with an `unavailable` error, the sequences the core was
running are ended for the stages here, and the front reconnects to the next core: at the
same address, or where `locate` says the core now is (a Ray replica restarted elsewhere).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from time import monotonic
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
import msgspec
import structlog
from prometheus_client import CollectorRegistry, generate_latest

from flowllm.config import EngineConfig
from flowllm.engine.async_engine import AsyncEngine
from flowllm.engine.core import placement_of
from flowllm.engine.core_protocol import (
    CONTROL_DECODER,
    GRAMMAR_CHECK_TIMEOUT_S,
    HEARTBEAT_STALE_S,
    METRICS_TIMEOUT_S,
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
from flowllm.engine.span_relay import Spans, WantSpans, decode_span
from flowllm.graph.channel import type_members
from flowllm.graph.remote import Boundary, Peer, PeerGone, RemoteChannel
from flowllm.graph.runtime import Graph
from flowllm.graph.spans import SpanSink
from flowllm.graph.transport import connect
from flowllm.graph.validator import ValidGraph
from flowllm.graph.wire import channel_codecs, wiring_digest
from flowllm.messages import ChoiceEvents, RequestError, StructuredOutputs, request_ids_of
from flowllm.metrics import MergedMetrics
from flowllm.stages.services import EngineServices, already_loaded
from flowllm.validation import constraint_error

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

RECONNECT_INTERVAL_S = 0.05
CORE_LOST = RequestError(
    request_id="",
    message="The engine core stopped while this request ran; retry it.",
    kind="unavailable",
)

Locate = Callable[[], Awaitable[str]]
"""Where the core listens now, asked before each connection (the address may change); it
waits while nobody knows, and an OSError makes the front ask again."""


class ModelFacts:
    """What the front's stages read of the model, which lives in the core."""

    def __init__(self, ready: CoreReady) -> None:
        self.vocab_size = ready.vocab_size
        self.max_position_embeddings = ready.max_model_len


class CoreLink:
    """The front's connection to the core: the `Peer`, its heartbeat, what it runs."""

    def __init__(
        self,
        graph: ValidGraph,
        address: str | Locate,
        index: int,
        *,
        token: str = "",
        core_lost: RequestError = CORE_LOST,
    ) -> None:
        self.address = address
        self.index = index
        self.token = token
        self.core_lost = core_lost  # the answer to requests in flight when the core goes
        self.wiring = wiring_digest(graph.channels)
        self.front, self.core = placement_of(graph)
        self.log = structlog.get_logger("flowllm.front").bind(front=index)
        self.ready: CoreReady | None = None
        self.core_address = ""  # where the latest connection went
        self.connected = anyio.Event()
        self.last_beat = 0.0
        self.core_healthy = False
        self.core_metrics: bytes = b""  # the latest the core sent
        self.sibling_metrics: tuple[bytes, ...] = ()  # the other fronts', sent with it
        self._metrics_asked: dict[int, anyio.Event] = {}
        # constraints sent to the core to compile: query -> its answer, once it comes
        self._grammars_asked: dict[int, tuple[anyio.Event, list[GrammarChecked]]] = {}
        self._queries = itertools.count()
        self.ownership = Ownership()  # the sequences the core runs for this front
        self.services: EngineServices | None = None
        self.peer = Peer(
            self.core,
            0,
            channel_codecs(graph.channels),
            on_control=self._on_control,
            undeliverable=self._undeliverable,
            observe=self._observe,
            replaceable=True,
        )
        self._choice_channels = [
            name
            for name, channel in graph.channels.items()
            if channel.crosses
            and graph.placement[channel.dst.stage] == self.front
            and ChoiceEvents in (type_members(channel.message_type) or ())
        ]
        self.stopping = False
        self.graph: Graph | None = None  # the front's graph, once it runs
        self._spans_wanted = False

    async def fresh_core_metrics(self) -> str:
        """The core's metrics now (the latest it sent, if it is away or slow to answer)."""
        if self.peer.attached:
            query = next(self._queries)
            answered = self._metrics_asked[query] = anyio.Event()
            self.peer.send_control(MetricsQuery(query=query))
            with anyio.move_on_after(METRICS_TIMEOUT_S):
                await answered.wait()
            self._metrics_asked.pop(query, None)
        return self.core_metrics.decode()

    async def check_constraint(
        self, request_id: str, spec: StructuredOutputs
    ) -> RequestError | None:
        """validate's check of a request's constraint, compiled by the core; the error
        of a constraint that does not compile, or the 503 of a core gone or too slow."""
        if not self.peer.attached:
            return self._lost(request_id)
        query = next(self._queries)
        answered, answer = self._grammars_asked[query] = (anyio.Event(), [])
        self.peer.send_control(CheckGrammar(query=query, spec=spec))
        with anyio.move_on_after(GRAMMAR_CHECK_TIMEOUT_S):
            await answered.wait()
        self._grammars_asked.pop(query, None)
        if not answer:
            return self._lost(request_id)
        if answer[0].message is None:
            return None
        return constraint_error(request_id, answer[0].message, answer[0].param)

    def elsewhere_metrics(self) -> list[str]:
        """The latest metrics of the core and of the other fronts, as Prometheus text."""
        return [text.decode() for text in (self.core_metrics, *self.sibling_metrics)]

    def want_spans(self, want: bool) -> None:
        """The front's graph gained its first span sink or lost its last: tell the core,
        which sends its spans only while they are read (and again after a reconnection)."""
        self._spans_wanted = want
        self.peer.send_control(WantSpans(want))

    @property
    def alive(self) -> bool:
        """Connected, and the core beat lately and says its graph is healthy."""
        return (
            self.peer.attached
            and self.core_healthy
            and monotonic() - self.last_beat < HEARTBEAT_STALE_S
        )

    def _on_control(self, _peer: Peer, payload: Any) -> None:
        message = CONTROL_DECODER.decode(payload)
        if isinstance(message, Heartbeat):
            self.last_beat = monotonic()
            self.core_healthy = message.healthy
        elif isinstance(message, MetricsQuery):  # the core gathers every front's
            text = generate_latest(self.services.registry) if self.services else b""
            self.peer.send_control(MetricsReply(query=message.query, text=text))
        elif isinstance(message, MetricsReply):
            self.core_metrics = message.text
            self.sibling_metrics = message.fronts
            answered = self._metrics_asked.pop(message.query, None)
            if answered is not None:
                answered.set()
        elif isinstance(message, CoreReady):
            self.ready = message
            self.last_beat = monotonic()
            self.core_healthy = message.healthy
            if self._spans_wanted:
                self.peer.send_control(WantSpans(True))  # a new core: tell it afresh
            self.connected.set()
        elif isinstance(message, Spans):
            if self.graph is not None:
                for span in message.spans:
                    self.graph.span_sinks.relay(
                        span.stage, decode_span(span), span.started, span.duration, span.queue_wait
                    )
        elif isinstance(message, GrammarChecked):
            asked = self._grammars_asked.pop(message.query, None)
            if asked is not None:
                asked[1].append(message)
                asked[0].set()
        elif isinstance(message, FailRequest):
            if self.services is not None:
                self.services.mailboxes.fail(message.error)
        elif isinstance(message, Refused):
            self.log.error("the core refused this front", reason=message.reason)

    def _observe(self, _peer: Peer, channel: str, message: object) -> None:
        self.ownership.learn(message)  # which sequences run, and end

    def watch_outbound(self, channels: dict[str, Any]) -> None:
        """Learn requests and finishes from what this front sends the core."""
        for channel in channels.values():
            if isinstance(channel, RemoteChannel):
                channel.add_tap(lambda message, _sent: self.ownership.arrived(0, message))

    def _undeliverable(self, _channel: str, message: object) -> None:
        if self.services is None:
            return
        for request_id in request_ids_of(message):
            self.services.mailboxes.fail(self._lost(request_id))

    def _lost(self, request_id: str) -> RequestError:
        return msgspec.structs.replace(self.core_lost, request_id=request_id)

    async def run(self) -> None:
        """Connect, carry the channels, reconnect after the core went away; forever."""
        while not self.stopping:
            try:
                address = self.address if isinstance(self.address, str) else await self.address()
                sock = await connect(address)
            except OSError:
                await anyio.sleep(RECONNECT_INTERVAL_S)
                continue
            self.core_address = address
            hello = Hello(front=self.index, wiring=self.wiring, pid=os.getpid(), token=self.token)
            ready = self.ready
            with contextlib.suppress(PeerGone):
                await self.peer.attach(sock, greeting=hello)
            if not self.stopping:
                self._core_lost()
                if self.ready is ready:  # refused, or gone before it greeted: not at once
                    await anyio.sleep(RECONNECT_INTERVAL_S)

    def _core_lost(self) -> None:
        self.core_healthy = False
        if self.connected.is_set():
            self.log.error("the engine core went away; failing requests in flight")
        if self.services is not None:
            self.services.mailboxes.fail_all(self._lost)
        ended = tuple(self.ownership.live_seqs_of(0))
        self.ownership = Ownership()
        for answered, _ in self._grammars_asked.values():  # unanswered: the core is gone
            answered.set()
        self._grammars_asked.clear()
        if ended:
            for name in self._choice_channels:
                self.peer.inject(name, ChoiceEvents(step_id=-1, ended=ended))


class FrontEngine(AsyncEngine):
    """The front's part of a placed graph, joined to the core by `link`."""

    def __init__(self, graph: Graph, services: EngineServices, link: CoreLink) -> None:
        super().__init__(graph, services)
        self.link = link

    @property
    def healthy(self) -> bool:
        return self.graph.healthy and self.link.alive

    async def elsewhere(self) -> str:
        """The core's metrics now, as Prometheus text (the web page's live view)."""
        return await self.link.fresh_core_metrics()

    async def refresh_metrics(self) -> None:
        """Fetch the core's metrics, for the next rendering of `metrics_registry`."""
        await self.link.fresh_core_metrics()

    @functools.cached_property
    def metrics_registry(self) -> CollectorRegistry:
        """This front's metrics, the other fronts' and the core's latest, one family per
        name."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(MergedMetrics(self.services.registry, self.link.elsewhere_metrics))
        return registry

    @classmethod
    @asynccontextmanager
    async def connect(
        cls,
        config: EngineConfig,
        graph: ValidGraph,
        address: str | Locate,
        *,
        index: int = 0,
        token: str = "",
        core_lost: RequestError = CORE_LOST,
        tokenizer: PreTrainedTokenizerBase | None = None,
        derived_from: EngineServices | None = None,
        stop_timeout: float = 30.0,
        span_sinks: Sequence[SpanSink] = (),
        **graph_options: Any,
    ) -> AsyncIterator[FrontEngine]:
        """Run the front's part of `graph` for the body, the core at `address` (a Unix
        socket path or HOST:PORT, or a `Locate` that finds it), greeted with `token`;
        `core_lost`: what requests in flight get when the core goes away (their ids
        replaced); `tokenizer`: one already loaded, else loaded here while the core
        starts; `derived_from`: an earlier connection's services to the same core, whose
        tokenizer tables this one reuses."""
        from flowllm.models.tokenizer import load_tokenizer, tokenizer_source

        link = CoreLink(graph, address, index, token=token, core_lost=core_lost)
        async with anyio.create_task_group() as tg:
            tg.start_soon(link.run)
            if tokenizer is None:
                tokenizer = await anyio.to_thread.run_sync(
                    lambda: load_tokenizer(*tokenizer_source(config))
                )
            await link.connected.wait()
            assert link.ready is not None
            services = EngineServices(
                config=config,
                model=ModelFacts(link.ready),
                tokenizer_loader=already_loaded(tokenizer),
                kv_caches=[],
                num_blocks=link.ready.num_blocks,
                max_model_len=link.ready.max_model_len,
                eos_token_ids=link.ready.eos_token_ids,
                device=None,
                pooler=link.ready.pooler,
                check_constraint=link.check_constraint,
            )
            if derived_from is not None:
                services.share_derived_with(derived_from)
            link.services = services
            tg.start_soon(link.peer.pump_overflow)
            async with AsyncEngine.start(
                graph=graph,
                services=services,
                stop_timeout=stop_timeout,
                span_sinks=span_sinks,
                process=link.front,
                boundary=Boundary({link.core: [link.peer]}),
                on_stop=lambda: _drain(link, services),
                on_span_sinks=link.want_spans,
                **graph_options,
            ) as engine:
                link.watch_outbound(engine.graph.channels)
                link.graph = engine.graph
                yield cls(engine.graph, services, link)
            link.stopping = True
            link.peer.detach()
            tg.cancel_scope.cancel()


async def _drain(link: CoreLink, services: EngineServices) -> None:
    """A graceful stop, intake stopped: let the requests here finish (the graph's stop
    bounds the wait), then end what the core feeds here, so the stages drain and return."""
    try:
        while len(services.mailboxes) and link.peer.attached:
            await anyio.sleep(0.02)
    finally:
        link.peer.close_inbound()
