"""The ingress's EngineClient: each API request goes to one engine replica's front.

The ingress runs one front per replica (`ReplicaLink`), each the per-request half of the
placed graph (admission, validation, tokenization, detokenization, delivery) joined to
its replica's engine core as a front process is to the core of a single server.
`submit_all` routes the request (flowllm/scale_out/router.py) among the replicas that
serve and hands it to that replica's front: its mailboxes, admission (503 with
Retry-After when that front is full), aborts (which reach the core and free the
blocks) and errors are the front's own. A replica that dies fails its requests in
flight with a 503 (`replica_failed`) at once, as a front answers for a lost core, and is
left out of routing until its front has reconnected to the core Ray started in its place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from prometheus_client import CollectorRegistry

from flowllm.config import EngineConfig, RequestLimits
from flowllm.engine.front import FrontEngine
from flowllm.graph.validator import ValidGraph
from flowllm.mailbox import Mailbox, Overloaded
from flowllm.messages import GenerateRequest
from flowllm.models.pooler_config import PoolerConfig
from flowllm.scale_out.replica_link import ReplicaLink, locate, replica_failed
from flowllm.scale_out.replica_metrics import ReplicaSeries, RoutingMetrics
from flowllm.scale_out.router import Router

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RoutedEngine:
    """Replicas behind one EngineClient (flowllm.engine.client), routed by `router`."""

    def __init__(self, links: Sequence[ReplicaLink], router: Router) -> None:
        self._links = list(links)
        self._router = router
        self._first = self._links[0].front
        self._stopping = False
        self.metrics_registry = CollectorRegistry(auto_describe=False)
        self.metrics_registry.register(ReplicaSeries(self._links))
        self._routing = RoutingMetrics(self.metrics_registry, self._links)

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        replicas: Sequence[tuple[str, Any, str]],
        *,
        config: EngineConfig,
        graph: ValidGraph,
        routing: str,
        imbalance_bound: int,
        tokenizer: PreTrainedTokenizerBase,
        stop_timeout: float = 30.0,
    ) -> AsyncIterator[RoutedEngine]:
        """Route over `replicas` ((Serve deployment name, its DeploymentHandle, its token))
        for the body, a front of `graph` connected to each one's core."""
        async with AsyncExitStack() as fronts:
            links = []
            for index, (name, handle, token) in enumerate(replicas):
                front = await fronts.enter_async_context(
                    FrontEngine.connect(
                        config,
                        graph,
                        locate(name, handle),
                        token=token,
                        core_lost=replica_failed(name),
                        tokenizer=tokenizer,
                        stop_timeout=stop_timeout,
                    )
                )
                links.append(ReplicaLink(index, name, front))
            router = Router(
                routing,
                [link.front.services.num_blocks for link in links],
                config.cache.block_size,
                imbalance_bound,
            )
            engine = cls(links, router)
            try:
                yield engine
            finally:
                engine._stopping = True  # the fronts drain as the stack closes them

    # -- EngineClient ---------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._first.model_name

    @property
    def max_model_len(self) -> int:
        return self._first.max_model_len

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._first.tokenizer

    @property
    def healthy(self) -> bool:
        """Serving while any replica serves (see `health_detail` for the degraded case)."""
        return any(link.healthy for link in self._links)

    @property
    def health_detail(self) -> str:
        """/health's body: empty when every replica serves, else which ones do not."""
        down = [link.name for link in self._links if not link.healthy]
        if not down:
            return ""
        return (
            f"degraded: {len(self._links) - len(down)} of {len(self._links)} replicas "
            f"serving; down: {', '.join(down)}"
        )

    @property
    def accepting(self) -> bool:
        return not self._stopping and self.healthy

    @property
    def full(self) -> bool:
        """Every replica that serves is full (or none serves): `submit_all` would refuse."""
        return self._stopping or all(link.front.full for link in self._links if link.healthy)

    @property
    def limits(self) -> RequestLimits:
        return self._first.limits

    @property
    def pooler(self) -> PoolerConfig | None:
        return self._first.pooler

    @property
    def links(self) -> Sequence[ReplicaLink]:
        return self._links

    def submit(self, request: GenerateRequest) -> Mailbox:
        return self.submit_all((request,))[0]

    def submit_all(self, requests: Sequence[GenerateRequest]) -> list[Mailbox]:
        """Route the request's prompts (together) to a replica that serves; its front's
        admission decides (Overloaded, RequestFailed as a single server's)."""
        serving = [link for link in self._links if link.healthy]
        if not serving or self._stopping:
            raise Overloaded()
        for link in self._links:
            if link.restarted():
                self._router.forget(link.index)  # a new process: its cache is empty
        route = self._router.choose(requests, serving)
        self._routing.observe(route)
        return self._links[route.replica.index].front.submit_all(requests)

    async def drain(self, timeout: float) -> None:
        """Stop admitting (503), let the requests in flight finish for up to `timeout`
        seconds, then answer those still running with a 503 (an error event on a
        stream): a single server's drain, run before Serve's own, which cuts streams."""
        self._stopping = True
        async with anyio.create_task_group() as tg:
            for link in self._links:
                tg.start_soon(link.front.graph.stop, timeout)

    def abort(self, request_id: str) -> None:
        for link in self._links:
            if link.front.services.mailboxes.get(request_id) is not None:
                link.front.abort(request_id)
                return

    async def refresh_metrics(self) -> None:
        """Fetch every replica's core metrics, for the next rendering of /metrics."""
        async with anyio.create_task_group() as tg:
            for link in self._links:
                tg.start_soon(link.front.refresh_metrics)
