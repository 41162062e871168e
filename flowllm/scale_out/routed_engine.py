"""The ingress's EngineClient: each API request goes to one engine replica over Ray.

`submit_all` answers at once, as the local engine does: it routes the request, opens
local mailboxes and starts the replica's `generate` stream; a pump task delivers the
stream's chunks into the mailboxes. What the replica refuses arrives as the stream's first
event and fails the mailboxes with the error a single server gives (503 with Retry-After
when overloaded, the 400 otherwise), which the API answers before any byte is sent.

Aborting cancels the replica's stream (the replica then aborts the sub-requests, freeing
their blocks there); one sub-request of a request with several prompts is aborted by name.
A replica that dies fails its in-flight requests with a 503 and is left out of routing
until a probe finds it (restarted by Ray) serving again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.abc import TaskGroup
from prometheus_client import CollectorRegistry

from flowllm.config import RequestLimits
from flowllm.mailbox import Mailbox, Overloaded
from flowllm.messages import GenerateRequest, RequestError
from flowllm.scale_out.replica_link import PROBE_INTERVAL_S, PROBE_TIMEOUT_S, ReplicaLink
from flowllm.scale_out.replica_metrics import ReplicaSeries, RoutingMetrics
from flowllm.scale_out.router import Router
from flowllm.scale_out.wire import ChunkEvent, ErrorEvent, decode_event, encode_submission

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class RemoteCall:
    """One API request's `generate` stream on a replica, and its local mailboxes."""

    def __init__(self, link: ReplicaLink, boxes: list[Mailbox], response: Any) -> None:
        self.link = link
        self.boxes = {box.request_id: box for box in boxes}
        self.response = response  # ray.serve.handle.DeploymentResponseGenerator
        self.aborted: set[str] = set()
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self.response.cancel()

    def fail(self, error: RequestError) -> None:
        """Answer every unfinished sub-request with `error` (under its own id)."""
        for request_id, box in self.boxes.items():
            if not box.done:
                box.fail(msgspec.structs.replace(error, request_id=request_id))


def _replica_failed(link: ReplicaLink) -> RequestError:
    return RequestError(
        request_id="",
        message=f"The engine replica serving this request ({link.name}) failed; retry.",
        kind="unavailable",
        code="replica_failed",
    )


_OVERLOADED = RequestError(
    request_id="",
    message="The server is overloaded; retry later.",
    kind="unavailable",
    code="server_overloaded",
)


class RoutedEngine:
    """Replicas behind one EngineClient (flowllm.engine.client), routed by `router`."""

    def __init__(
        self,
        links: Sequence[ReplicaLink],
        router: Router,
        *,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        max_model_len: int,
        limits: RequestLimits,
        task_group: TaskGroup,
    ) -> None:
        self._links = list(links)
        self._router = router
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._limits = limits
        self._task_group = task_group
        self._calls: dict[str, RemoteCall] = {}  # sub-request id -> its call
        self._stopping = False
        self.metrics_registry = CollectorRegistry(auto_describe=False)
        self.metrics_registry.register(ReplicaSeries(self._links))
        self._routing = RoutingMetrics(self.metrics_registry, self._links)

    @classmethod
    @asynccontextmanager
    async def start(
        cls,
        handles: Sequence[tuple[str, Any]],
        *,
        routing: str,
        imbalance_bound: int,
        tokenizer: PreTrainedTokenizerBase,
        limits: RequestLimits,
    ) -> AsyncIterator[RoutedEngine]:
        """Route over the replicas `handles` ((deployment name, DeploymentHandle)) for the
        body; their probes run meanwhile."""
        links = [ReplicaLink(i, name, handle) for i, (name, handle) in enumerate(handles)]
        described: list[dict[str, Any]] = [{} for _ in links]

        async def describe(link: ReplicaLink) -> None:
            described[link.index] = await link.handle.describe.remote()

        async with anyio.create_task_group() as startup:
            for link in links:
                startup.start_soon(describe, link)
        first = described[0]
        router = Router(
            routing,
            [d["num_blocks"] for d in described],
            first["block_size"],
            imbalance_bound,
        )
        async with anyio.create_task_group() as task_group:
            engine = cls(
                links,
                router,
                tokenizer=tokenizer,
                model_name=first["model_name"],
                max_model_len=first["max_model_len"],
                limits=limits,
                task_group=task_group,
            )
            task_group.start_soon(engine._probe_forever)
            try:
                yield engine
            finally:
                engine._stopping = True
                task_group.cancel_scope.cancel()

    # -- EngineClient ---------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

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
    def limits(self) -> RequestLimits:
        return self._limits

    @property
    def links(self) -> Sequence[ReplicaLink]:
        return self._links

    def submit(self, request: GenerateRequest) -> Mailbox:
        return self.submit_all((request,))[0]

    def submit_all(self, requests: Sequence[GenerateRequest]) -> list[Mailbox]:
        serving = [link for link in self._links if link.healthy]
        if not serving or self._stopping:
            raise Overloaded()
        route = self._router.choose(requests, serving)
        self._routing.observe(route)
        link = self._links[route.replica.index]
        boxes = []
        for request in requests:
            # n < 1 is the replica's admission's to refuse: a mailbox of no choices would
            # be done, and answer empty, before that refusal arrives.
            box = Mailbox(request.request_id, max(1, request.params.n))
            box.arrival_time = request.arrival_time
            boxes.append(box)
        response = link.streaming.generate.remote(encode_submission(requests))
        call = RemoteCall(link, boxes, response)
        for box in boxes:
            self._calls[box.request_id] = call
        link.in_flight += 1
        self._task_group.start_soon(self._pump, call)
        return boxes

    def abort(self, request_id: str) -> None:
        call = self._calls.get(request_id)
        if call is None or request_id in call.aborted:
            return
        call.aborted.add(request_id)
        if all(box.done or rid in call.aborted for rid, box in call.boxes.items()):
            call.cancel()
        else:
            call.link.handle.abort.remote(request_id)

    # -- the streams and the probes ---------------------------------------------------------

    async def _pump(self, call: RemoteCall) -> None:
        """Deliver one call's events into its mailboxes until it ends, however it ends."""
        try:
            async for payload in call.response:
                event = decode_event(payload)
                if isinstance(event, ChunkEvent):
                    chunk = event.chunk
                    box = call.boxes.get(chunk.request_id)
                    if box is not None and chunk.request_id not in call.aborted:
                        box.put(chunk)
                elif isinstance(event, ErrorEvent):
                    box = call.boxes.get(event.error.request_id)
                    if box is not None:
                        box.fail(event.error)
                else:  # Refused: nothing was admitted
                    call.fail(event.error or _OVERLOADED)
        except Exception:
            if not call.cancelled:
                call.link.mark_down()  # a probe brings it back once it serves again
                call.fail(_replica_failed(call.link))
        finally:
            call.cancel()  # a no-op for a stream that ended; frees the replica's otherwise
            call.fail(_replica_failed(call.link))  # a stream that ended short of finishing
            call.link.in_flight -= 1
            for request_id in call.boxes:
                self._calls.pop(request_id, None)

    async def _probe_forever(self) -> None:
        while True:
            async with anyio.create_task_group() as probes:
                for link in self._links:
                    probes.start_soon(self._probe, link)
            await anyio.sleep(PROBE_INTERVAL_S)

    async def _probe(self, link: ReplicaLink) -> None:
        try:
            with anyio.fail_after(PROBE_TIMEOUT_S):
                answer = await link.handle.probe.remote()
        except Exception:
            link.mark_down()
            return
        if link.update(answer):
            self._router.forget(link.index)
